"""``check --fit --write FILE``: the fitted config as one YAML file instead of overrides to paste.

The file holds every value that does not come from verl's defaults (the ``-c`` files', the command line's, a
preset's, the hardware's, and the micro batches ``--fit`` filled), each with a comment saying where it came from.
Config-group choices (``model_engine=megatron``) and the tool's own arguments (``hardware.*``) stay on the command
line. Before anything is written the file is composed again, in a private temporary directory, with those
arguments: it must give every value of the config it was made from, or nothing is written.
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.audit import yaml_scalar
from verl_safe_launch.compose import Composed, compose, config_groups
from verl_safe_launch.config_view import nest
from verl_safe_launch.inputs import ComposeRequest, OverrideToken, cli_tokens
from verl_safe_launch.provenance import Layer, Source


@dataclass(frozen=True)
class FittedFile:
    """What ``--write`` writes: the YAML text, how many values it sets, the keys ``--fit`` filled, and the
    arguments that stay on the command line with it."""

    text: str
    values: int
    fitted: tuple[str, ...]
    arguments: tuple[str, ...]

    def check_command(self, path: Path) -> str:
        """The ``check`` command that reads the written file."""
        words = ["verl-safe-launch", "check", "-c", str(path), *self.arguments]
        return " ".join(shlex.quote(word) for word in words)


def fitted_file(composed: Composed, path: Path) -> FittedFile:
    """The YAML of ``composed`` for ``path``, composed again before it is returned (a RuntimeError, an internal
    error, when it does not give the same config: then nothing may be written)."""
    view = composed.view
    kept: list[tuple[str, object, Source]] = []
    for key in view.values:
        prov = view.prov(key)
        if prov is not None and prov.source.layer is not Layer.VERL:
            kept.append((key, view.get(key), prov.source))
    fitted = tuple(key for key, _, source in kept if (source.reason or "").startswith("--fit:"))
    arguments = tuple(t.text for t in _stays_on_command_line(composed))
    lines = [
        "# verl config written by verl-safe-launch check --fit --write: the -c files, the command line and the",
        "# fitted micro batches in one file; each value says where it came from. Check it with:",
        f"#   {_one_line(FittedFile('', 0, (), arguments).check_command(path))}",
    ]
    _emit(nest((key, (value, source)) for key, value, source in kept), 0, lines)
    result = FittedFile("\n".join(lines) + "\n", len(kept), fitted, arguments)
    _recompose(result, composed)
    return result


def _stays_on_command_line(composed: Composed) -> list[OverrideToken]:
    """Config-group choices (a YAML file cannot make them) and the tool's hardware arguments."""
    groups = config_groups()
    chosen = [t for t in composed.verl_overrides if t.text.partition("=")[0].lstrip("+~") in groups]
    hardware = [
        OverrideToken(f"hardware.{name}={value}", source)
        for name, (value, source) in composed.tool.hardware.items()
    ]
    return [*chosen, *hardware]


def _recompose(result: FittedFile, composed: Composed) -> None:
    with tempfile.TemporaryDirectory(prefix="vsl-fit-") as folder:
        trial = Path(folder) / "fitted.yaml"
        trial.write_text(result.text, encoding="utf-8")
        again = compose(ComposeRequest(overrides=cli_tokens(list(result.arguments)), config_files=(trial,)))
    before, after = dict(composed.view.values), dict(again.view.values)
    differ = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    if differ:
        shown = ", ".join(f"{k}: {before.get(k)!r} → {after.get(k)!r}" for k in differ[:5])
        raise RuntimeError(
            f"the fitted YAML does not compose back to the same config ({shown}); nothing written"
        )


def _emit(tree: dict[str, object], depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for key, node in tree.items():
        if isinstance(node, tuple):
            value, source = node
            lines.append(f"{pad}{key}: {yaml_scalar(value)}  # {_one_line(source.describe())}")
        else:
            assert isinstance(node, dict)
            lines.append(f"{pad}{key}:")
            _emit(node, depth + 1, lines)


def _one_line(text: str) -> str:
    """Text for a YAML comment: a line break must not end the comment and start a key."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


__all__ = ["FittedFile", "fitted_file"]

"""Interpolation bombs, wide values and long chains are refused before anything resolves them."""

from __future__ import annotations

import functools
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from verl_safe_launch.compose import compose
from verl_safe_launch.compose.budget import (
    MAX_INTERPOLATION_DEPTH,
    MAX_INTERPOLATION_WORK,
    MAX_RESOLVED_CHARS,
)
from verl_safe_launch.errors import ConfigError
from verl_safe_launch.inputs import ComposeRequest

Cli = Callable[..., CliResult]


def doubling(levels: int) -> str:
    """Each key reads the one before twice: 2**levels resolutions, 590 bytes for 16 levels."""
    lines = ["trainer:", "  x0: ab"]
    lines += [f'  x{i}: "${{trainer.x{i - 1}}}${{trainer.x{i - 1}}}"' for i in range(1, levels)]
    return "\n".join([*lines, f"  project_name: ${{trainer.x{levels - 1}}}", ""])


def wide(count: int) -> str:
    return 'trainer:\n  x: a\n  project_name: "' + "${trainer.x}" * count + '"\n'


def chain(length: int) -> str:
    lines = ["trainer:", "  y0: a", *(f"  y{i}: ${{trainer.y{i - 1}}}" for i in range(1, length))]
    return "\n".join([*lines, f"  project_name: ${{trainer.y{length - 1}}}", ""])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            doubling(16),
            "error: interpolation limit: trainer.x11=${trainer.x10}${trainer.x10} takes over "
            f"{MAX_INTERPOLATION_WORK:,} interpolation steps to resolve (the limit)",
        ),
        (
            wide(85_000),
            "error: interpolation limit: trainer.project_name=${trainer.x}${trainer.x}${trainer.x}${trainer.x}"
            f"${{trainer... resolves to over {MAX_RESOLVED_CHARS:,} characters (the limit)",
        ),
        (
            chain(1_990),
            "error: interpolation limit: trainer.y33=${trainer.y32} follows a chain of over "
            f"{MAX_INTERPOLATION_DEPTH} interpolations (the limit)",
        ),
    ],
    ids=["doubling", "wide", "chain"],
)
@pytest.mark.parametrize("verb", ["check", "show"])
def test_interpolation_bombs_are_refused_naming_the_key(
    tmp_path: Path, cli: Cli, verb: str, text: str, message: str
) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    result = cli(verb, "-c", str(path))
    lines = result.err.splitlines()
    assert result.code == 2
    assert lines[0] == message
    assert lines[1].startswith(f"  where: user file, {path}:")


def test_a_doubling_bomb_on_the_command_line_is_refused(cli: Cli) -> None:
    tokens = ["+trainer.x0=ab"]
    tokens += [f"+trainer.x{i}=${{trainer.x{i - 1}}}${{trainer.x{i - 1}}}" for i in range(1, 16)]
    result = cli("check", *tokens, "trainer.project_name=${trainer.x15}")
    assert result.code == 2
    assert result.err.startswith("error: interpolation limit: trainer.x")
    assert "where: command line, argument" in result.err


def test_the_limit_on_total_work_names_the_limit(tmp_path: Path, cli: Cli) -> None:
    values = "".join(f'  w{i}: "' + "${trainer.x}" * 1_300 + '"\n' for i in range(4))
    path = tmp_path / "many.yaml"
    path.write_text("trainer:\n  x: a\n" + values)
    result = cli("show", "-c", str(path))
    assert result.code == 2
    assert f"takes over {MAX_INTERPOLATION_WORK:,} steps (the limit)" in result.err.splitlines()[0]


def test_a_modest_chain_and_verls_defaults_pass(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(chain(20))
    result = cli("show", "-c", str(path), "--key", "trainer.project_name")
    assert (result.code, result.out.split()[:3]) == (0, ["trainer.project_name", "=", "a"])


# --- property: random small YAML with interpolations, its work counted independently --------------------------

_REF = re.compile(r"\$\{trainer\.(k\d+)\}")
_CAP = 10 * MAX_INTERPOLATION_WORK


def _naive(values: dict[str, str]) -> tuple[int, int, int]:
    """(steps, depth, longest text) of resolving every value as OmegaConf does: each read afresh, no cache.

    The text counts each value's own characters, its ``${...}`` included: an upper bound of what it resolves to.
    """

    @functools.cache
    def cost(key: str) -> tuple[int, int, int]:
        refs = _REF.findall(values[key])
        steps, depth, chars = len(refs), 0, len(values[key])
        for ref in refs:
            inner = cost(ref)
            steps, chars = min(steps + inner[0], _CAP), min(chars + inner[2], _CAP)
            depth = max(depth, inner[1] + 1)
        return steps, depth, chars

    costs = [cost(key) for key in values]
    return sum(c[0] for c in costs), max(c[1] for c in costs), max(c[2] for c in costs)


@st.composite
def _configs(draw: st.DrawFn) -> dict[str, str]:
    """Up to 16 keys, each reading up to three of the two before (no cycles): from nothing to a 3**15 bomb."""
    size = draw(st.integers(6, 16))
    values = {"k0": draw(st.sampled_from(["a", "bb", "1"]))}
    for i in range(1, size):
        refs = [i - 1, max(0, i - 2), i - 1][: draw(st.integers(1, 3))]
        literal = draw(st.sampled_from(["", "x", "-"]))
        values[f"k{i}"] = literal + "".join(f"${{trainer.k{r}}}" for r in refs) or "v"
    return values


VERL_STEPS = 200
"""An upper bound of the steps verl's own defaults take (about 120), counted in the same budget."""


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_configs())
def test_random_interpolations_compose_within_the_budget_or_are_refused(values: dict[str, str]) -> None:
    """Accepted: OmegaConf's own resolution took at most the budget; refused: the budget really was exceeded."""
    from omegaconf import OmegaConf

    steps, depth, chars = _naive(values)
    lines = "".join(f'  {k}: "{v}"\n' for k, v in values.items())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random.yaml"
        path.write_text("trainer:\n" + lines)
        try:
            composed = compose(ComposeRequest(overrides=(), config_files=(path,)))
        except ConfigError as exc:
            event("refused")
            assert exc.what.startswith("interpolation limit: ")
            assert (
                steps + VERL_STEPS > MAX_INTERPOLATION_WORK
                or depth >= MAX_INTERPOLATION_DEPTH
                or chars > MAX_RESOLVED_CHARS
            )
            return
    event("accepted")
    assert steps <= MAX_INTERPOLATION_WORK and depth <= MAX_INTERPOLATION_DEPTH
    resolved = OmegaConf.to_container(composed.cfg.trainer, resolve=True)
    assert isinstance(resolved, dict)
    for key in values:
        assert len(str(resolved[key])) <= MAX_RESOLVED_CHARS
        assert composed.view.get(f"trainer.{key}") == resolved[key]

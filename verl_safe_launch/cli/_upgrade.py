"""``upgrade``: rewrite a launch script or YAML written for an older verl release for the installed one."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from verl_safe_launch.audit import (
    INSTALLED_SERIES,
    RELEASES,
    Change,
    command_line,
    hydra_literal,
    plan_migration,
    render_yaml,
)
from verl_safe_launch.cli._common import add_format_arg, make_parser, parse, print_json
from verl_safe_launch.errors import EXIT_OK, ManyErrors, UsageError, VslError
from verl_safe_launch.files import check_target, check_text_name, ensure_directory, output_path, write_atomic
from verl_safe_launch.inputs import OverrideToken, read_yaml
from verl_safe_launch.preflight import UpgradeReport, upgrade_launch
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell import ScriptLaunch, choose_launch, read_script

EXAMPLES = """\
  verl-safe-launch upgrade run_qwen_grpo_v05.sh -o upgraded/
  verl-safe-launch upgrade old_run.yaml --from 0.7 -o upgraded/ --force
  verl-safe-launch upgrade run_ppo_sp.sh --gpus 16 -o upgraded/
  verl-safe-launch upgrade scripts/train/*.sh -o upgraded/    # a project's scripts: verl imported once

Writes DIR/NAME.yaml (the launch's values for the installed verl, each citing its original line and the rule that
moved it) and prints the one command that runs it. Moved keys are mapped, global micro batch sizes become per-GPU
sizes (divided by the data-parallel ranks, GPUs / Ulysses SP, shown; --gpus N where the script's GPU count
cannot be read, else refused), removed keys are dropped and reported with what replaces them, and defaults that
changed since the launch's release are listed with the override that keeps the old behaviour. Nothing ambiguous is
guessed: such overrides are kept as written and reported, and a release the keys do not pin down is asked for
(--from). Every "keep the old behaviour" line is applied and checked (composition, check, verl's validate_config)
before it is shown.
"""

ORDER = (
    "moved",
    "converted",
    "kept",
    "added",
    "removed",
    "refused",
    "project",
    "unread",
    "unknown",
    "unresolved",
    "default",
    "range",
)


def main(args: Sequence[str], offset: int) -> int:
    """Run ``upgrade``."""
    parser = make_parser("upgrade", "Rewrite a launch for the installed verl release.", EXAMPLES)
    parser.add_argument(
        "launch_files",
        nargs="+",
        metavar="SCRIPT.sh|FILE.yaml",
        help="bash launch scripts or YAML configs (several: verl is imported once for all of them)",
    )
    parser.add_argument(
        "-o", "--output", required=True, type=output_path, metavar="DIR", help="folder for the upgraded YAML"
    )
    parser.add_argument(
        "--from",
        dest="source",
        default="auto",
        choices=("auto", *[s for s in RELEASES if s != INSTALLED_SERIES]),
        help="the verl release the launch was written for (default: detected from its keys)",
    )
    parser.add_argument(
        "--gpus",
        type=_positive,
        metavar="N",
        help="the launch's GPU count, where the script's trainer.n_gpus_per_node × nnodes cannot be read",
    )
    parser.add_argument("--launch", type=int, metavar="N", help="which launch of a script (1-based)")
    parser.add_argument("--force", action="store_true", help="overwrite DIR/NAME.yaml if it exists")
    add_format_arg(parser)
    ns = parse(parser, args)
    paths = [Path(name) for name in ns.launch_files]
    if len(paths) > 1 and ns.launch is not None:
        raise UsageError(
            "--launch N picks a launch of one script", where="--launch", fix="upgrade that script on its own"
        )
    folder = Path(ns.output)
    _distinct_outputs(paths, folder)
    # A name that cannot be written is refused before the slower work that would end in writing it.
    for path in paths:
        check_text_name(folder / f"{path.stem}.yaml", where="-o/--output")
    launches = _each(paths, lambda path: _read(path, ns.launch))  # unreadable inputs first: they are quick
    # every script upgraded before anything is written: one that fails writes nothing
    planned = _each(list(zip(paths, launches, strict=True)), lambda pair: _plan(*pair, ns, folder))
    for item in planned:
        write_atomic(item.output, item.yaml, force=ns.force, inputs=item.inputs, where="-o/--output")
    if ns.format == "json":
        shown = [
            {**_json(d.path, d.report, d.changes, d.output, d.command), "fits": list(d.report.fits)}
            for d in planned
        ]
        print_json(shown[0] if len(shown) == 1 else {"schema": 1, "scripts": shown})
    else:
        print("\n\n".join(_text(d.path, d.report, d.changes, d.output, d.command) for d in planned))
    return EXIT_OK


@dataclass(frozen=True)
class _Planned:
    """One script upgraded, not yet written."""

    path: Path
    report: UpgradeReport
    changes: list[Change]
    output: Path
    yaml: str
    command: str
    inputs: list[Path]


T = TypeVar("T")
U = TypeVar("U")


def _each(items: Sequence[U], work: Callable[[U], T]) -> list[T]:
    """``work`` on every item; every user error among them raised together."""
    done: list[T] = []
    problems: list[VslError] = []
    for item in items:
        try:
            done.append(work(item))
        except VslError as exc:
            problems.append(exc)
    if problems:
        raise problems[0] if len(problems) == 1 else ManyErrors(problems)
    return done


def _plan(path: Path, launch: ScriptLaunch, ns: argparse.Namespace, folder: Path) -> _Planned:
    report = upgrade_launch(path, launch, ns.source, ns.gpus)
    output = _output(folder, path, ns.force)
    migration = plan_migration(report.launch, report.composed, output)
    notes = [Change("unresolved", _noted_key(note), note) for note in migration.notes]
    changes = _ordered([*report.changes, *notes])
    inputs = [path, *launch.config_files]
    return _Planned(path, report, changes, output, render_yaml(migration), command_line(migration), inputs)


def _distinct_outputs(paths: Sequence[Path], folder: Path) -> None:
    """Two inputs with one name would write one DIR/NAME.yaml: refused before anything runs."""
    seen: dict[str, Path] = {}
    for path in paths:
        other = seen.setdefault(path.stem, path)
        if other is not path and other.resolve() != path.resolve():
            raise UsageError(
                f"{other} and {path} would both be written to {folder / (path.stem + '.yaml')}",
                where="-o/--output",
                fix="upgrade them to different -o folders, one at a time",
            )
        if other is not path:
            raise UsageError(f"{path} is named twice", where="command line", fix="name each script once")


def _noted_key(note: str) -> str:
    """The key a migration note is about (``left out key=value ...``, ``not migrated: key=value ...``), if any."""
    found = re.match(r"(?:left out|not migrated:) [+~]*([A-Za-z_][\w.-]*)=", note)
    return found.group(1) if found else ""


def _ordered(changes: Sequence[Change]) -> list[Change]:
    """The lines grouped by kind, in ``ORDER``."""
    return [c for kind in ORDER for c in changes if c.kind == kind]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number of GPUs, got {text!r}")
    return value


def _read(path: Path, wanted: int | None) -> ScriptLaunch:
    if path.suffix in (".yaml", ".yml"):
        doc = read_yaml(path, expand_dots=True)
        tokens = tuple(
            OverrideToken(
                f"{leaf.key}={hydra_literal(leaf.value)}",
                Source(Layer.SCRIPT, file=str(path), line=leaf.line, raw=f"{leaf.key}: {leaf.value}"),
            )
            for leaf in doc.leaves
        )
        return ScriptLaunch(str(path), 1, 1, tokens)
    return choose_launch(read_script(path), wanted, str(path))


def _output(folder: Path, source: Path, force: bool) -> Path:
    """DIR/NAME.yaml, DIR created when missing; never the input itself, never an existing file without --force."""
    ensure_directory(folder, where="-o/--output")
    target = folder / f"{source.stem}.yaml"
    check_target(target, force=force, inputs=[source], where="-o/--output")
    return target


def _text(path: Path, report: UpgradeReport, changes: Sequence[Change], output: Path, command: str) -> str:
    lines = [
        f"upgrade {path}: written for verl {report.source} ({report.detected}); target: the installed verl"
    ]
    for change in changes:
        where = f" (line {change.line})" if change.line is not None else ""
        arrow = f" -> {change.new_key}" if change.new_key and change.new_key != change.key else ""
        head = f"{change.key}{arrow}{where}: " if change.key else ""
        lines.append(f"{change.kind:<10} {head}{change.detail}")
        if change.fix:
            lines.append(f"           keep the old behaviour: {shlex.quote(change.fix)}")
    lines.append(f"wrote {output}")
    lines.append(command)
    return "\n".join(lines)


def _json(
    path: Path, report: UpgradeReport, changes: Sequence[Change], output: Path, command: str
) -> dict[str, object]:
    return {
        "schema": 1,
        "input": str(path),
        "source_release": report.source,
        "detected": report.detected,
        "output": str(output),
        "command": command,
        "changes": [
            {
                "kind": c.kind,
                "key": c.key,
                "new_key": c.new_key,
                "line": c.line,
                "detail": c.detail,
                "fix": c.fix,
            }
            for c in changes
        ],
        "summary": {kind: sum(c.kind == kind for c in changes) for kind in ORDER},
    }

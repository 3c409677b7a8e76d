"""``migrate``: turn a raw launch script into a user YAML file (a comment per key) and a verl-safe-launch command."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from verl_safe_launch.audit import Migration, command_line, plan_migration, render_yaml
from verl_safe_launch.cli._common import make_parser, parse
from verl_safe_launch.compose import compose
from verl_safe_launch.errors import EXIT_OK, InputError, UsageError
from verl_safe_launch.findings import has_errors
from verl_safe_launch.inputs import DETECT_ENV, ComposeRequest, cli_tokens, detect_hardware, split_tool_tokens
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.render import summary_line
from verl_safe_launch.shell import ScriptLaunch, read_script

EXAMPLES = """\
  verl-safe-launch migrate run_qwen2-7b_grpo.sh -o run.yaml
  verl-safe-launch migrate two_runs.sh --launch 2 -o real_run.yaml --force

The YAML holds the script's effective values; config group choices (model_engine=...), deletions (~key) and
tool tokens stay on the printed command line. Values the script cannot determine are listed, not guessed.
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``migrate``."""
    parser = make_parser("migrate", "Turn a raw launch script into a user YAML file and a command.", EXAMPLES)
    parser.add_argument("script", metavar="SCRIPT", help="the bash launch script")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.yaml", help="the YAML file to write")
    parser.add_argument("--force", action="store_true", help="overwrite FILE.yaml if it exists")
    parser.add_argument("--launch", type=int, metavar="N", help="which launch of the script (1-based)")
    ns = parse(parser, args)
    output = Path(ns.output)
    if output.exists() and not ns.force:
        raise InputError(f"{output} already exists", where="-o/--output", fix="pass --force to overwrite it")
    launch = _choose(read_script(ns.script), ns.launch, ns.script)
    migration = plan_migration(launch, compose(launch.request(lenient=True)), output)
    write_atomic(output, render_yaml(migration))
    print(command_line(migration))
    for note in migration.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"note: {preflight_note(migration, output)}", file=sys.stderr)
    return EXIT_OK


def preflight_note(migration: Migration, output: Path) -> str:
    """The pre-flight of what was written (the YAML plus the printed command), as one line."""
    verl_tokens, tool = split_tool_tokens(cli_tokens(list(migration.cli_tokens)))
    request = ComposeRequest(
        overrides=(*verl_tokens,), config_files=(*migration.config_files, output), lenient=True
    )
    pre = run_preflight(compose(request), detect_hardware(tool, env={DETECT_ENV: "0"}))
    line = f"pre-flight of the migrated config: {summary_line(pre.findings)}"
    if has_errors(pre.findings):
        line += f"; see them with: {command_line(migration).replace('verl-safe-launch', 'verl-safe-launch check', 1)}"
    return line


def _choose(launches: tuple[ScriptLaunch, ...], wanted: int | None, script: str) -> ScriptLaunch:
    if wanted is None and len(launches) == 1:
        return launches[0]
    choices = ", ".join(f"{launch.index} (line {launch.line})" for launch in launches)
    if wanted is None:
        raise UsageError(
            f"{script} has {len(launches)} launches: {choices}", fix="choose one with --launch N"
        )
    if not 1 <= wanted <= len(launches):
        raise UsageError(f"{script} has no launch {wanted}", where="--launch", fix=f"use one of: {choices}")
    return launches[wanted - 1]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, then rename it into place."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}", where="-o/--output") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

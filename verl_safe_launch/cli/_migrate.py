"""``migrate``: turn a raw launch script into a user YAML file (a comment per key) and a verl-safe-launch command."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from verl_safe_launch.audit import command_line, plan_migration, render_yaml
from verl_safe_launch.cli._common import make_parser, parse
from verl_safe_launch.compose import compose
from verl_safe_launch.errors import EXIT_OK, UsageError
from verl_safe_launch.files import check_target, write_atomic
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
    check_target(output, force=ns.force, inputs=[ns.script], where="-o/--output")
    launch = _choose(read_script(ns.script), ns.launch, ns.script)
    migration = plan_migration(launch, compose(launch.request(lenient=True)), output)
    inputs = [ns.script, *launch.config_files]
    write_atomic(output, render_yaml(migration), force=ns.force, inputs=inputs, where="-o/--output")
    print(command_line(migration))
    for note in migration.notes:
        print(f"note: {note}", file=sys.stderr)
    return EXIT_OK


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

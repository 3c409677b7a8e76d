"""``migrate``: turn a raw launch script into a user YAML file (a comment per key) and a verl-safe-launch command."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from verl_safe_launch.audit import (
    INSTALLED_SERIES,
    Change,
    Migration,
    check_command,
    command_line,
    installed_defaults,
    plan_migration,
    plan_upgrade,
    render_yaml,
)
from verl_safe_launch.backends import JobMigration, allocation_findings, compose_allocation, plan_job
from verl_safe_launch.cli._common import make_parser, parse
from verl_safe_launch.compose import compose
from verl_safe_launch.errors import EXIT_OK, InputError
from verl_safe_launch.files import check_target, check_text_name, write_atomic
from verl_safe_launch.findings import has_errors
from verl_safe_launch.inputs import (
    DETECT_ENV,
    GPU_KEYS,
    PRIMARY_CONFIG,
    ComposeRequest,
    cli_tokens,
    detect_hardware,
    split_tool_tokens,
)
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.render import escape, summary_line
from verl_safe_launch.shell import (
    JobScript,
    choose_launch,
    read_job_script,
    read_script,
    seeded_env,
)

EXAMPLES = """\
  verl-safe-launch migrate run_qwen2-7b_grpo.sh -o run.yaml
  verl-safe-launch migrate two_runs.sh --launch 2 -o real_run.yaml --force
  verl-safe-launch migrate job.sbatch -o migrated/

The YAML holds the script's effective values; config group choices (model_engine=...), deletions (~key) and
tool tokens stay on the printed command line. Values the script cannot determine are listed, not guessed.
A Slurm job script (#SBATCH lines) prints the 'verl-safe-launch slurm ...' command that writes a new job for
the same allocation; -o DIR writes DIR/SCRIPT.yaml.
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``migrate``."""
    parser = make_parser("migrate", "Turn a raw launch script into a user YAML file and a command.", EXAMPLES)
    parser.add_argument("script", metavar="SCRIPT", help="the bash launch script or Slurm job script")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE.yaml|DIR",
        help="the YAML file to write (or its directory)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite FILE.yaml if it exists")
    parser.add_argument("--launch", type=int, metavar="N", help="which launch of the script (1-based)")
    parser.add_argument(
        "--fix",
        action="store_true",
        help="write deprecated spellings the new way (global micro batch sizes become per-GPU sizes)",
    )
    ns = parse(parser, args)
    output = _output(ns.output, ns.script)
    check_target(output, force=ns.force, inputs=[ns.script], where="-o/--output")
    launches = read_script(ns.script)
    job = read_job_script(ns.script)
    if job.is_job:
        launches = read_script(ns.script, env=seeded_env(job.allocation.slurm_env()))
    launch = choose_launch(launches, ns.launch, ns.script)
    fixes: tuple[Change, ...] = ()
    if ns.fix:
        fixed = plan_upgrade(launch.tokens, INSTALLED_SERIES, "--fix", installed_defaults())
        launch, fixes = replace(launch, tokens=fixed.tokens), fixed.changes
    composed = compose(launch.request(lenient=True))
    migration = plan_migration(launch, composed, output)
    plan = plan_job(job, composed.view) if job.is_job else None
    if plan is not None:
        migration = _as_job(migration, job, plan, output)
    inputs = [ns.script, *launch.config_files]
    write_atomic(output, render_yaml(migration), force=ns.force, inputs=inputs, where="-o/--output")
    print(escape(command_line(migration)))
    for change in fixes:
        print(
            escape(f"fixed: {change.key} -> {change.new_key} (line {change.line}): {change.detail}"),
            file=sys.stderr,
        )
    for note in migration.notes:
        print(escape(f"note: {note}"), file=sys.stderr)
    print(escape(f"note: {preflight_note(migration, output, plan)}"), file=sys.stderr)
    return EXIT_OK


def _output(text: str, script: str) -> Path:
    """``-o FILE.yaml``, or ``-o DIR`` (an existing directory, or a path ending in '/'): DIR/SCRIPT.yaml."""
    check_text_name(text, where="-o/--output")
    path = Path(text)
    if path.is_dir() or text.endswith(os.sep):
        if not path.is_dir():
            try:
                path.mkdir(parents=True)
            except OSError as exc:
                raise InputError(
                    f"cannot create {path}: {exc.strerror or exc}", where="-o/--output"
                ) from None
        return path / f"{Path(script).stem}.yaml"
    return path


def _as_job(migration: Migration, job: JobScript, plan: JobMigration, output: Path) -> Migration:
    """The ``slurm`` command for the same allocation; GPU counts come from it, not from the YAML."""
    keys = {key for key, _, _ in GPU_KEYS}
    dropped = [e for e in migration.entries if e.key in keys]
    entries = tuple(e for e in migration.entries if e.key not in keys)
    tokens = tuple(t for t in migration.cli_tokens if t.partition("=")[0] not in keys)
    fills = {key: getattr(job.allocation, name) for key, name, _ in GPU_KEYS}
    notes = [
        f"{e.key}={e.value} (line {e.source.line}) is left out: the job fills it from the allocation"
        + (f" ({fills[e.key].value})" if fills[e.key] is not None else "")
        for e in dropped
    ]
    script = output.with_name(f"{output.stem}.job.sbatch")
    configs = (*(str(p) for p in migration.config_files), str(output))
    command = plan.command(configs, tokens, str(script))
    allocation = [(key, name, fills[key].value) for key, name, _ in GPU_KEYS if fills[key] is not None]
    check = [f"{key}={value}" for key, _, value in allocation] + [
        f"hardware.{n}={v}" for _, n, v in allocation
    ]
    return replace(
        migration,
        entries=entries,
        cli_tokens=tokens,
        notes=(*migration.notes, *notes, *plan.notes),
        command=command,
        check_tokens=tuple(check),
    )


def preflight_note(migration: Migration, output: Path, plan: JobMigration | None) -> str:
    """The pre-flight of what was written (the YAML plus the printed command), as one line: for a job, the one
    the printed ``slurm`` command runs (its allocation, its --cpus-per-task)."""
    configs = (*migration.config_files, output)
    flag = "--config-name="
    names = [t.removeprefix(flag) for t in migration.cli_tokens if t.startswith(flag)]
    config_name = names[0] if names else PRIMARY_CONFIG
    if plan is not None:
        request = ComposeRequest(
            overrides=cli_tokens([t for t in migration.cli_tokens if not t.startswith(flag)]),
            config_files=configs,
            lenient=True,
            config_name=config_name,
        )
        hardware = cli_tokens(
            [f"hardware.nodes={plan.nodes}", f"hardware.gpus_per_node={plan.gpus_per_node}"]
        )
        composed, profile = compose_allocation(request, hardware, "slurm")
        findings, _ = allocation_findings(composed, profile, plan.cpus_per_task, plan.nodes)
        see = migration.command
    else:
        texts = [t for t in [*migration.cli_tokens, *migration.check_tokens] if not t.startswith(flag)]
        verl_tokens, tool = split_tool_tokens(cli_tokens(texts))
        request = ComposeRequest(
            overrides=(*verl_tokens,), config_files=configs, lenient=True, config_name=config_name
        )
        findings = list(
            run_preflight(compose(request), detect_hardware(tool, env={DETECT_ENV: "0"})).findings
        )
        see = check_command(migration)
    line = f"pre-flight of the migrated config: {summary_line(findings)}"
    if has_errors(findings):
        line += f"; see them with: {see}"
    return line

"""``check``: the pre-flight alone; the exit code says go (0) or no-go (1)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_safe_launch.cli._common import (
    add_compose_args,
    add_config_name_args,
    add_verbose_arg,
    make_parser,
    parse,
    print_json,
    use_verl_of_project,
    with_config_name,
)
from verl_safe_launch.compose import Composed
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, UsageError
from verl_safe_launch.files import check_target, write_atomic
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import request_from_args
from verl_safe_launch.preflight import fitted_file, header_lines, run_preflight
from verl_safe_launch.presets import compose_for_launch
from verl_safe_launch.render import json_document, render_report

EXAMPLES = """\
  verl-safe-launch check -c launch_examples/grpo_6gpu.yaml
  verl-safe-launch check actor_rollout_ref.rollout.name=vllm data.train_batch_size=64 --format json
  verl-safe-launch check -c run.yaml trainer.n_gpus_per_node=8 && sbatch job.sbatch
  verl-safe-launch check --fit -c launch_examples/grpo_6gpu.yaml hardware.gpu_memory_gb=80
  verl-safe-launch check --fit --write fitted.yaml -c run.yaml hardware.gpu_memory_gb=80

--write FILE (with --fit) writes the fitted config as one YAML file, composed again before it is written; a
NO-GO config is not written. An existing FILE is replaced only with --force, an input never.

exit status: 0 go (clean or warnings only), 1 no-go (errors; with --strict warnings too), 2 bad input.
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``check``."""
    parser = make_parser(
        "check",
        "Compose the config, audit the overrides and run every pre-flight rule; launch nothing.",
        EXAMPLES,
    )
    add_compose_args(parser)
    add_config_name_args(parser)
    parser.add_argument(
        "--fit",
        action="store_true",
        help="fill every unset micro batch with the memory fit (and let a preset's grow), then judge",
    )
    parser.add_argument(
        "--write", metavar="FILE", help="with --fit: write the fitted config as one YAML file (checked first)"
    )
    parser.add_argument("--force", action="store_true", help="with --write: replace an existing FILE")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 on warnings too (a key set twice, a group of one...)"
    )
    add_verbose_arg(parser)
    ns = parse(parser, args)
    target = Path(ns.write) if ns.write else None
    if target is not None:
        if not ns.fit:
            raise UsageError("--write needs --fit", where="command line", fix="add --fit")
        check_target(target, force=ns.force, inputs=ns.config or (), where="--write")
    use_verl_of_project(ns)
    preflight = run_preflight(
        compose_for_launch(with_config_name(ns, request_from_args(ns, args, offset)), fit=ns.fit)
    )
    written = _write(target, preflight.composed, ok=preflight.ok, force=ns.force, inputs=ns.config or ())
    if ns.format == "json":
        print_json(json_document({"written": written} if target else {}, preflight.findings))
    else:
        print("\n".join(header_lines()))
        print(render_report(preflight.findings, verbose=ns.verbose), end="")
        if written is not None:
            print(
                f"wrote {written['path']}: {written['values']} values, {len(written['fitted'])} fitted by --fit"
            )
            print(f"check it with: {written['check']}")
    if target is not None and written is None:
        print(f"{target} not written: the config is NO-GO (fix the errors first)", file=sys.stderr)
    warned = any(f.severity is Severity.WARNING for f in preflight.findings)
    return EXIT_OK if preflight.ok and not (ns.strict and warned) else EXIT_PREFLIGHT


def _write(
    target: Path | None, composed: Composed, *, ok: bool, force: bool, inputs: Sequence[str]
) -> dict[str, Any] | None:
    """``--write``: the fitted YAML written (when GO), and what the report says about it."""
    if target is None or not ok:
        return None
    made = fitted_file(composed, target)
    write_atomic(target, made.text, force=force, inputs=inputs, where="--write")
    return {
        "path": str(target),
        "values": made.values,
        "fitted": list(made.fitted),
        "check": made.check_command(target),
    }

"""``check``: the pre-flight alone; the exit code says go (0) or no-go (1)."""

from __future__ import annotations

from collections.abc import Sequence

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
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT
from verl_safe_launch.inputs import request_from_args
from verl_safe_launch.preflight import header_lines, run_preflight
from verl_safe_launch.presets import compose_for_launch
from verl_safe_launch.render import json_document, render_report

EXAMPLES = """\
  verl-safe-launch check -c launch_examples/grpo_6gpu.yaml
  verl-safe-launch check actor_rollout_ref.rollout.name=vllm data.train_batch_size=64 --format json
  verl-safe-launch check -c run.yaml trainer.n_gpus_per_node=8 && sbatch job.sbatch
  verl-safe-launch check --fit -c launch_examples/grpo_6gpu.yaml hardware.gpu_memory_gb=80

exit status: 0 go (clean or warnings only), 1 no-go (errors), 2 bad input.
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
    add_verbose_arg(parser)
    ns = parse(parser, args)
    use_verl_of_project(ns)
    preflight = run_preflight(
        compose_for_launch(with_config_name(ns, request_from_args(ns, args, offset)), fit=ns.fit)
    )
    if ns.format == "json":
        print_json(json_document({}, preflight.findings))
    else:
        print("\n".join(header_lines()))
        print(render_report(preflight.findings, verbose=ns.verbose), end="")
    return EXIT_OK if preflight.ok else EXIT_PREFLIGHT

"""Time the analytic memory estimate per config (target ≤ 50 ms) and ``--fit`` over all knobs (target ≤ 1 s).

    python bench/estimate_speed.py

Composition is done once per config and not timed; each figure is the median of several runs.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "launch_examples" / "grpo_6gpu.yaml"
ARR = "actor_rollout_ref"
CONFIGS: dict[str, list[str]] = {
    "6-GPU GRPO example, 80 GiB": [],
    "dynamic batch sizes": [f"{ARR}.actor.use_dynamic_bsz=true"],
    "GAE with a 0.5B critic": ["algorithm.adv_estimator=gae", "critic.model.path=Qwen/Qwen2.5-0.5B"],
    "72B, offload, TP 8 (8 GPUs)": [
        f"{ARR}.model.path=Qwen/Qwen2.5-72B-Instruct",
        "trainer.n_gpus_per_node=8",
        f"{ARR}.rollout.tensor_model_parallel_size=8",
        f"{ARR}.actor.fsdp_config.param_offload=true",
        f"{ARR}.actor.fsdp_config.optimizer_offload=true",
        "data.train_batch_size=64",
        f"{ARR}.actor.ppo_mini_batch_size=64",
    ],
}


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    from verl_safe_launch.compose import compose
    from verl_safe_launch.context import HardwareFacts
    from verl_safe_launch.inputs import ComposeRequest, cli_tokens
    from verl_safe_launch.memory import estimate_memory, fit_knobs
    from verl_safe_launch.preflight import rule_context
    from verl_safe_launch.rules import run_rules

    print(f"{'config':<32} {'estimate ms':>12} {'fit ms':>8} {'knobs':>6}")
    worst_est = worst_fit = 0.0
    for name, overrides in CONFIGS.items():
        composed = compose(ComposeRequest(overrides=cli_tokens(overrides), config_files=(EXAMPLE,)))
        ctx = rule_context(composed, HardwareFacts(gpu_memory_gb=80))
        run_rules(ctx)  # import the rule modules outside the timing
        est = median_ms(functools.partial(estimate_memory, ctx), 50)
        fit = median_ms(functools.partial(fit_knobs, ctx), 5)
        knobs = len(fit_knobs(ctx))
        worst_est, worst_fit = max(worst_est, est), max(worst_fit, fit)
        print(f"{name:<32} {est:12.2f} {fit:8.1f} {knobs:6d}")
    print(f"slowest: estimate {worst_est:.2f} ms (target 50), fit {worst_fit:.0f} ms (target 1000)")
    return 0 if worst_est <= 50 and worst_fit <= 1000 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""verl's batch arithmetic, layout and mode checks as one rule table, with fixes and the step-by-step explanation."""

from __future__ import annotations

from verl_safe_launch.rules.catalog import RULES, run_rules
from verl_safe_launch.rules.engines import rollout_tp_ok
from verl_safe_launch.rules.explain import explain, header, render_text
from verl_safe_launch.rules.fixes import (
    KeyFix,
    divisor_fix,
    divisors,
    first_tokens,
    nearest,
    render_fix,
    search_fix,
    set_fix,
)
from verl_safe_launch.rules.kit import sources
from verl_safe_launch.rules.layout import heads_ok as ulysses_heads_ok
from verl_safe_launch.rules.mcore import megatron_tp_ok
from verl_safe_launch.rules.plan import (
    ACTOR_MICRO,
    ACTOR_MINI,
    LOGPROB_MICRO,
    REF_MICRO,
    ROLLOUT_N,
    ROLLOUT_TP,
    TRAIN_BATCH,
    BatchPlan,
    batch_plan,
    effective_sp,
    exact,
    lcm,
    pos_int,
    round_up,
    sync_steps,
    with_values,
)
from verl_safe_launch.rules.resources import CPUS_PER_GPU, CpuNeed, GpuNeed, cpu_need, gpu_need

__all__ = [
    "ACTOR_MICRO",
    "ACTOR_MINI",
    "CPUS_PER_GPU",
    "LOGPROB_MICRO",
    "REF_MICRO",
    "ROLLOUT_N",
    "ROLLOUT_TP",
    "RULES",
    "TRAIN_BATCH",
    "BatchPlan",
    "CpuNeed",
    "GpuNeed",
    "KeyFix",
    "batch_plan",
    "cpu_need",
    "divisor_fix",
    "divisors",
    "effective_sp",
    "exact",
    "explain",
    "first_tokens",
    "gpu_need",
    "header",
    "lcm",
    "megatron_tp_ok",
    "nearest",
    "pos_int",
    "render_fix",
    "render_text",
    "rollout_tp_ok",
    "round_up",
    "run_rules",
    "search_fix",
    "set_fix",
    "sources",
    "sync_steps",
    "ulysses_heads_ok",
    "with_values",
]

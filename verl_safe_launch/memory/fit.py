"""Fit each micro-batch knob (or token budget) to the GPU: the largest value that fits and passes every rule."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Severity
from verl_safe_launch.memory.estimate import (
    DEFAULT_MARGIN,
    StageEstimate,
    estimate_memory,
    stage_at,
    stage_fits,
)
from verl_safe_launch.rules import batch_plan, divisors, run_rules, with_values

BUDGET_STEP = 512  # token budgets are fitted to a multiple of this
MAX_RULE_TRIES = 64  # candidates checked against the rules, downward from the memory limit


@dataclass(frozen=True)
class KnobFit:
    """The fitted value of one knob: ``value`` None when nothing fits; ``peak_gib`` the stage peak at it."""

    key: str
    current: int | None
    value: int | None
    peak_gib: float
    reason: str
    stage: str = ""
    add: bool = False
    fits_up_to: int | None = None
    """The largest value that fits the GPU, before the rules (``value`` is the largest that also passes them)."""

    @property
    def override(self) -> str | None:
        """The override to paste (``+key=value`` when verl's YAML does not have the key)."""
        if self.value is None:
            return None
        return f"{'+' if self.add else ''}{self.key}={self.value}"


def fit_knobs(
    ctx: RuleContext, margin: float = DEFAULT_MARGIN, cap: Mapping[str, int] | None = None
) -> tuple[KnobFit, ...]:
    """For every training stage's knob: the largest value that fits the GPU with ``margin`` and breaks no rule."""
    estimate = estimate_memory(ctx, margin=margin)
    gpu = ctx.hardware.gpu_memory_gb
    knobs = [(s.name, s.knob) for s in estimate.stages if s.name != "rollout" and s.knob]
    if estimate.missing or gpu is None:
        why = (
            estimate.missing
            or "GPU memory unknown: set hardware.gpu_memory_gb (e.g. hardware.gpu_memory_gb=80)"
        )
        return tuple(KnobFit(k, _current(ctx, k), None, 0.0, why, name) for name, k in knobs)
    return tuple(_fit_one(ctx, name, key, margin, gpu, (cap or {}).get(key)) for name, key in knobs)


def _current(ctx: RuleContext, key: str) -> int | None:
    value = ctx.view.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stage_rows(ctx: RuleContext, stage: str) -> int | None:
    """Sequences per GPU the stage splits into micro batches (None when unknown)."""
    plan = batch_plan(ctx.view)
    return {
        "actor update": plan.mini_per_gpu,
        "old log-prob": plan.logprob_rows,
        "ref log-prob": plan.ref_rows,
        "critic": plan.logprob_rows,  # the critic's budget also sizes its forward over all rows
    }.get(stage)


def upper_bound(ctx: RuleContext, stage: str, dynamic: bool) -> int:
    """The largest meaningful value: the per-GPU rows of the stage (× sequence length for a token budget)."""
    rows = stage_rows(ctx, stage)
    if dynamic:
        return (rows or 1024) * (batch_plan(ctx.view).max_seq_len or 1)
    return rows or 1024


def candidates(start: int, dynamic: bool, rows: int | None) -> list[int]:
    """Values to check against the rules, largest first: divisors of the per-GPU rows (verl splits them
    evenly) for a micro batch, multiples of the budget step for a token budget."""
    if dynamic:
        step = BUDGET_STEP if start >= BUDGET_STEP else 1
        return list(range(start - start % step, 0, -step))[:MAX_RULE_TRIES]
    if rows:
        return [d for d in reversed(divisors(rows)) if d <= start][:MAX_RULE_TRIES]
    return list(range(start, 0, -1))[:MAX_RULE_TRIES]


def _fit_one(ctx: RuleContext, stage: str, key: str, margin: float, gpu: float, cap: int | None) -> KnobFit:
    at = stage_at(ctx, stage, margin=margin)
    assert at is not None
    dynamic = "max_token_len" in key
    current, add = _current(ctx, key), key not in ctx.view
    top = upper_bound(ctx, stage, dynamic)
    if cap is not None:
        top = min(top, cap)
    limit = gpu / (1 + margin)
    largest = _largest(lambda v: _fits(at(v), gpu, margin), max(1, top))
    if largest is None:
        low = at(1 if not dynamic else BUDGET_STEP)
        why = f"even the smallest value needs {low.total:.1f} GiB of {gpu:g} GiB with the {margin:.0%} margin"
        return KnobFit(key, current, None, low.total, why + _offload_hint(ctx, stage), stage, add)
    value, blocked = _passes_rules(ctx, key, candidates(largest, dynamic, stage_rows(ctx, stage)))
    if value is None:
        return KnobFit(
            key,
            current,
            None,
            at(largest).total,
            f"no value ≤ {largest} passes the rules: {blocked}",
            stage,
            add,
        )
    est = at(value)
    return KnobFit(
        key,
        current,
        value,
        est.total,
        _reason(est, largest, value, (limit, gpu), blocked, dynamic),
        stage,
        add,
        largest,
    )


def _fits(est: StageEstimate, gpu: float, margin: float) -> bool:
    """What ``estimate`` calls ``fits`` (one test for both): the estimate with the margin, the band's top, within
    the GPU."""
    return stage_fits(est.total, est.high, gpu, margin)


def _largest(fits: Callable[[int], bool], top: int) -> int | None:
    """The largest v in [1, top] with fits(v), for a monotone predicate (binary search)."""
    if not fits(1):
        return None
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _passes_rules(ctx: RuleContext, key: str, values: list[int]) -> tuple[int | None, str]:
    """The first of ``values`` with no ERROR finding naming ``key`` (and the first rule that blocked one)."""
    first_block = ""
    for value in values:
        patched = with_values(ctx.view, {key: value})
        view = ConfigView(dict(patched.values), patched.provenance)
        errors = [
            f for f in run_rules(replace(ctx, view=view)) if f.severity is Severity.ERROR and key in f.keys
        ]
        if not errors:
            return value, first_block
        first_block = first_block or errors[0].rule_id
    return None, first_block or "no candidate"


def _reason(
    est: StageEstimate, largest: int, value: int, limits: tuple[float, float], blocked: str, dynamic: bool
) -> str:
    limit, gpu = limits
    text = (
        f"{est.name} peaks at {est.total:.1f} GiB, band up to {est.high:.1f} (limits: {limit:.1f} GiB with the "
        f"margin, the band within {gpu:g} GiB)"
    )
    if value < largest:
        text += f"; up to {largest} would fit, {value} is the largest valid value"
        why = f"a multiple of {BUDGET_STEP}" if dynamic else "it divides the per-GPU batch"
        text += f" ([{blocked}])" if blocked else f" ({why})"
    return text


def _offload_hint(ctx: RuleContext, stage: str) -> str:
    """What to try when no micro batch fits: offload, then FSDP2's CPU offload policy, then more GPUs."""
    prefix = "critic" if stage == "critic" else f"{ARR}.actor"
    fsdp = "critic.fsdp" if stage == "critic" else f"{prefix}.fsdp_config"
    view = ctx.view
    if view.get(f"{fsdp}.param_offload") is not True or view.get(f"{fsdp}.optimizer_offload") is not True:
        return f"; offload it ({fsdp}.param_offload=true {fsdp}.optimizer_offload=true)"
    if view.get(f"{prefix}.strategy") != "fsdp2" or view.get(f"{fsdp}.offload_policy") is not True:
        return f"; or keep the shards on the CPU ({prefix}.strategy=fsdp2 {fsdp}.offload_policy=true)"
    return "; or spread the shards over more GPUs (trainer.nnodes)"

"""Memory findings for the pre-flight: rollout KV cache and weights, and each stage's verdict against the GPU."""

from __future__ import annotations

from collections.abc import Mapping

from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.memory.defaults import flash_clause, flash_fits
from verl_safe_launch.memory.estimate import (
    DOES_NOT_FIT,
    FITS,
    OUT_OF_MEMORY,
    MemoryEstimate,
    StageEstimate,
    estimate_memory,
)
from verl_safe_launch.memory.fit import KnobFit, fit_knobs
from verl_safe_launch.memory.host import host_findings
from verl_safe_launch.memory.rollout import MAX_MODEL_LEN_KEY, TP_KEY, UTIL_KEY, RolloutFacts
from verl_safe_launch.memory.terms import GIB
from verl_safe_launch.rules import KeyFix, batch_plan, render_fix, set_fix, sources

OOM, TIGHT = "memory-stage-out-of-memory", "memory-stage-tight"
KV_ONE, KV_CONCURRENCY, WEIGHTS = (
    "rollout-kv-below-max-model-len",
    "rollout-kv-concurrency",
    "rollout-weights-per-rank",
)
UNKNOWN = "memory-model-unknown"
UNTRACED_ID = "memory-family-untraced"


def memory_findings(ctx: RuleContext, estimate: MemoryEstimate | None = None) -> list[Finding]:
    """Rollout checks and per-stage verdicts; nothing when the GPU size is unknown."""
    gpu = ctx.hardware.gpu_memory_gb
    if gpu is None:
        return []
    est = estimate or estimate_memory(ctx)
    if est.missing:
        return [Finding(UNKNOWN, Severity.INFO, (), f"memory estimate skipped: {est.missing}")]
    out = [Finding(UNKNOWN, Severity.INFO, (), note) for note in est.notes]
    if est.rollout is not None:
        out.extend(_rollout(ctx, est.rollout, gpu))
    out.extend(_verdicts(ctx, est))
    out.extend(host_findings(est.host, ctx.hardware.host_memory_from))
    return out


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _finding(
    ctx: RuleContext, rule_id: str, sev: Severity, keys: tuple[str, ...], msg: str, fix: str | None
) -> Finding:
    return Finding(rule_id, sev, keys, msg, fix, sources(ctx.view, keys))


def _util_fix(facts: RolloutFacts, tokens: int, gpu: float) -> KeyFix | None:
    need = facts.util_for(tokens, gpu)
    if need >= 0.95:
        return None
    return set_fix(UTIL_KEY, round(min(0.95, need + 0.005), 2))


def _tp_fix(ctx: RuleContext, facts: RolloutFacts) -> KeyFix | None:
    gpus = batch_plan(ctx.view).gpus
    return KeyFix(TP_KEY, (facts.tp * 2,)) if gpus and gpus % (facts.tp * 2) == 0 else None


def _rollout(ctx: RuleContext, facts: RolloutFacts, gpu: float) -> list[Finding]:
    kv = facts.kv_bytes
    if kv is None or facts.capacity_tokens is None:
        return []
    pool = f"gpu_memory_utilization {facts.util:g} × {gpu:g} GiB"
    if kv <= 0:
        msg = (
            f"the rollout engine's memory ({pool}) does not hold the model: weights {_gib(facts.weights_bytes)} "
            f"per GPU at TP {facts.tp} plus {_gib(facts.activation_bytes)} of activations leave no KV cache; "
            f"{facts.engine} will fail to start"
        )
        fix = render_fix([_util_fix(facts, facts.seq_len, gpu), _tp_fix(ctx, facts)])
        return [_finding(ctx, WEIGHTS, Severity.ERROR, (UTIL_KEY, TP_KEY), msg, fix)]
    graphs = f" − CUDA graphs {_gib(facts.graphs_in_pool)}" if facts.graphs_in_pool else ""
    head = (
        f"the KV cache holds ~{facts.capacity_tokens} tokens per rollout replica ({pool} − weights "
        f"{_gib(facts.weights_bytes)} − activations {_gib(facts.activation_bytes)}{graphs}, "
        f"{facts.kv_bytes_per_token // 1024} KiB per token)"
    )
    if facts.capacity_tokens < facts.max_model_len:
        origin = " (null: the model's max_position_embeddings)" if facts.max_model_len_from_model else ""
        msg = (
            f"{head}, fewer than one sequence of max_model_len {facts.max_model_len}{origin}; "
            f"{facts.engine} refuses to start"
        )
        fixes = [set_fix(MAX_MODEL_LEN_KEY, facts.seq_len), _util_fix(facts, facts.max_model_len, gpu)]
        keys = (MAX_MODEL_LEN_KEY, UTIL_KEY, TP_KEY)
        return [_finding(ctx, KV_ONE, Severity.ERROR, keys, msg, render_fix([*fixes, _tp_fix(ctx, facts)]))]
    if facts.capacity_tokens < facts.wanted_tokens:
        msg = (
            f"{head}, less than its {facts.concurrency} concurrent sequences × {facts.seq_len} tokens = "
            f"{facts.wanted_tokens}; sequences will be preempted and recomputed (slower, not out of memory)"
        )
        fix = render_fix([_util_fix(facts, facts.wanted_tokens, gpu), _tp_fix(ctx, facts)])
        return [_finding(ctx, KV_CONCURRENCY, Severity.WARNING, (UTIL_KEY, TP_KEY), msg, fix)]
    return []


def _verdicts(ctx: RuleContext, est: MemoryEstimate) -> list[Finding]:
    out: list[Finding] = []
    fits: dict[str, KnobFit] | None = None
    for stage in est.stages:
        if stage.verdict not in (OUT_OF_MEMORY, DOES_NOT_FIT):
            continue
        if fits is None and stage.name != "rollout":
            fits = {f.key: f for f in fit_knobs(ctx, est.margin)}
        out.append(_verdict(ctx, est, stage, fits or {}))
    return out + _untraced(ctx, est)


def _untraced(ctx: RuleContext, est: MemoryEstimate) -> list[Finding]:
    """A 'fits' of a model whose code could not be traced rests on a stand-in family's measured band."""
    judged = [s for s in est.stages if not s.traced and s.verdict == FITS]
    if not judged:
        return []
    named = ", ".join(f"{s.name} {s.verdict}" for s in judged)
    msg = f"{named} rest on a stand-in: {est.terms} (the whole band under the GPU size)"
    fix = "measure one step (verl-safe-launch run records each stage's peak) before relying on the margin"
    return [_finding(ctx, UNTRACED_ID, Severity.WARNING, (), msg, fix)]


def _verdict(
    ctx: RuleContext, est: MemoryEstimate, stage: StageEstimate, fits: Mapping[str, KnobFit]
) -> Finding:
    gpu = est.gpu_memory_gib or 0.0
    top = max(stage.components, key=lambda c: c[1])
    msg = (
        f"{stage.name} needs ~{stage.total:.1f} GiB per GPU (band {stage.low:.1f}–{stage.high:.1f}) of {gpu:g} GiB"
        f", peak at {stage.phase}; largest part: {top[0]} {top[1]:.1f} GiB"
    )
    oom = stage.verdict == OUT_OF_MEMORY
    if not oom and stage.total * (1 + est.margin) > gpu:
        msg += f"; it does not fit with the {est.margin:.0%} margin"
    elif not oom:
        msg += f"; it does not fit: the band's top is over {gpu:g} GiB"
    alt = flash_fits(ctx, est).get(stage.name)
    if alt is not None:
        msg += f"; {flash_clause(alt)}"
    if not stage.traced:
        arch = ctx.actor_arch.model_type if ctx.actor_arch else "unknown"
        msg += f"; the code of '{arch}' could not be traced (stand-in family, band ±{stage.band:.0%})"
    fit = fits.get(stage.knob or "")
    fix = fit.override if fit else None
    offloaded = ctx.view.get(PARAM_OFFLOAD) is True or ctx.view.get(OFFLOAD_POLICY) is True
    text = f"{fix} (est. {fit.peak_gib:.1f} GiB)" if fit and fix else _no_fit_fix(stage, fit, offloaded)
    keys = (stage.knob,) if stage.knob else ()
    return _finding(ctx, OOM if oom else TIGHT, Severity.ERROR if oom else Severity.WARNING, keys, msg, text)


PARAM_OFFLOAD = "actor_rollout_ref.actor.fsdp_config.param_offload"
OFFLOAD_POLICY = "actor_rollout_ref.actor.fsdp_config.offload_policy"


def _no_fit_fix(stage: StageEstimate, fit: KnobFit | None, offloaded: bool) -> str:
    if stage.name == "rollout":
        return f"lower {UTIL_KEY}" + ("" if offloaded else f", or offload the actor ({PARAM_OFFLOAD}=true)")
    return fit.reason if fit else "run 'verl-safe-launch estimate --fit' with the same arguments"

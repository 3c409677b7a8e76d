"""The memory plan of an adaptation: rollout memory fraction, rollout TP, offload and checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import RuleContext
from verl_safe_launch.inputs import GPU_KEYS
from verl_safe_launch.memory import MemoryEstimate, StageEstimate, estimate_memory, stage_at
from verl_safe_launch.presets.catalog import GPU_UTIL, MAX_MODEL_LEN
from verl_safe_launch.presets.state import Adaptation, critic_arch, heads_clause
from verl_safe_launch.rules import ROLLOUT_TP, batch_plan, divisors, pos_int, rollout_tp_ok, with_values

FSDP_CFG = "actor_rollout_ref.actor.fsdp_config"


CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing"


STRATEGY = "actor_rollout_ref.actor.strategy"


UTIL_STEPS = tuple(round(0.9 - 0.05 * i, 2) for i in range(15))  # 0.9 down to 0.2


FLOOR_UTIL = 0.2


@dataclass(frozen=True)
class _Rung:
    """One step of the OOM checklist: the knobs it turns and why."""

    changes: dict[str, Any]
    what: str


def _rungs(state: Adaptation) -> list[_Rung]:
    rungs = [_Rung({}, "")]
    if state.view.get(CHECKPOINTING) is False and state.free(CHECKPOINTING):
        rungs.append(_Rung({CHECKPOINTING: True}, "gradient checkpointing keeps one layer input per layer"))
    rungs.append(
        _Rung(
            {f"{FSDP_CFG}.optimizer_offload": True}, "the optimizer states wait on the CPU outside the update"
        )
    )
    rungs.append(
        _Rung({f"{FSDP_CFG}.param_offload": True}, "the parameters wait on the CPU outside their stages")
    )
    rungs.append(
        _Rung(
            {STRATEGY: "fsdp2", f"{FSDP_CFG}.offload_policy": True},
            "FSDP2's CPU offload policy keeps every shard on the CPU, the update included",
        )
    )
    return rungs


def _ok(stage: StageEstimate, gpu: float) -> bool:
    """Fits with the margin and the upper band stays within the GPU."""
    return stage.verdict == "fits" and stage.high <= gpu


class _Trial:
    """A candidate config for the memory plan: the adaptation so far plus a set of knob values."""

    def __init__(self, state: Adaptation, changes: dict[str, Any]) -> None:
        self.state = state
        self.changes = changes
        self.view = with_values(state.view, changes) if changes else state.view
        facts = state.profile.facts()
        self.gpu = facts.gpu_memory_gb or 0.0
        self.ctx = RuleContext(self.view, state.arch, critic_arch(state), facts)

    def with_(self, more: dict[str, Any]) -> _Trial:
        return _Trial(self.state, {**self.changes, **more})

    def estimate(self) -> MemoryEstimate:
        return estimate_memory(self.ctx)

    def training_block(self) -> StageEstimate | None:
        """The first training stage that does not fit even at its smallest micro batch."""
        est = self.estimate()
        for stage in est.stages:
            if stage.name == "rollout":
                continue
            at = stage_at(self.ctx, stage.name)
            smallest = at(1) if at is not None else stage
            if not _ok(smallest, self.gpu):
                return smallest
        return None


def memory_plan(state: Adaptation) -> None:
    """Walk the OOM checklist until every stage fits: rollout memory fraction and TP, then offload, then FSDP2's
    CPU offload; record each knob with its reason (nothing fits: the pre-flight says preset-cannot-fit)."""
    if state.profile.facts().gpu_memory_gb is None or state.arch is None:
        return
    if estimate_memory(_Trial(state, {}).ctx).missing:
        return
    taken: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    last: tuple[dict[str, Any], dict[str, str]] | None = None
    why_not = ""
    block: StageEstimate | None = None
    for rung in _rungs(state):
        trial = _Trial(state, {k: v for k, v in {**taken, **rung.changes}.items() if state.free(k)})
        if rung.changes and block is not None and not _lowers(trial, block):
            continue  # this knob does not touch what blocks (offload does not shrink the update)
        taken = {**taken, **rung.changes}
        for key in rung.changes:
            reasons[key] = f"{rung.what}; {why_not}" if why_not else rung.what
        rollout = _rollout_plan(state, trial)
        block = trial.training_block()
        plan = {**trial.changes, **(rollout[0] if rollout else {})}
        last = (plan, {**reasons, **(rollout[1] if rollout else {})})
        if rollout is not None and block is None:
            break
        why_not = _why_not(trial, rollout, block)
    assert last is not None
    plan, why = last
    for key, value in plan.items():
        state.change(key, value, why.get(key, "the memory plan"), knob=True)


def _lowers(trial: _Trial, block: StageEstimate) -> bool:
    """Whether the trial lowers the blocking stage's peak at its smallest micro batch."""
    at = stage_at(trial.ctx, block.name)
    return at is not None and at(1).total < block.total - 0.05


def _why_not(
    trial: _Trial, rollout: tuple[dict[str, Any], dict[str, str]] | None, block: StageEstimate | None
) -> str:
    gpu = trial.gpu
    if block is not None:
        return (
            f"without it {block.name} needs ~{block.total:.1f} GiB per GPU (band up to {block.high:.1f}) of "
            f"{gpu:g} GiB even at micro batch 1"
        )
    stage = trial.estimate().stage("rollout")
    resident = stage.get("optimizer") + stage.get("gradients") if stage else 0.0
    return (
        f"without it the actor's optimizer states resident during rollout ({resident:.1f} GiB per GPU) leave "
        f"vLLM no memory fraction ≥ {FLOOR_UTIL} that holds the weights and one full sequence within {gpu:g} GiB"
    )


def _rollout_plan(state: Adaptation, trial: _Trial) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The memory fraction and the smallest TP whose KV cache holds what the rollout needs, or None."""
    gpn = state.value(GPU_KEYS[0][0])
    if gpn is None:
        return None
    ok = [d for d in divisors(gpn) if rollout_tp_ok(state.view, state.arch, d)]
    tps = ok if state.free(ROLLOUT_TP) else []
    own = state.value(ROLLOUT_TP) or 1
    # the preset's TP when it fits, else the smallest larger one that does, else a smaller one
    tps = sorted(tps, key=lambda tp: (tp < own, tp if tp >= own else -tp)) or [own]
    current = trial.view.get(GPU_UTIL)
    preset_util = float(current) if isinstance(current, int | float) else 0.5
    utils = [preset_util]
    if state.free(GPU_UTIL):  # the preset's fraction, then lower ones, then higher ones as a last resort
        lower = [u for u in UTIL_STEPS if u < preset_util]
        utils += lower + [u for u in UTIL_STEPS if u > preset_util][::-1]
    mml = [None] + (
        [MAX_MODEL_LEN] if state.free(MAX_MODEL_LEN) and state.view.get(MAX_MODEL_LEN) is None else []
    )
    within, above = [u for u in utils if u <= preset_util], [u for u in utils if u > preset_util]
    for cap in mml:
        base, extra = trial, {}
        if cap is not None:
            seq = batch_plan(trial.view).max_seq_len
            if not seq:
                continue
            extra = {cap: seq}
            base = trial.with_(extra)
        # a higher fraction only when no TP fits at the preset's; a prompt's samples side by side in the KV
        # cache are preferred, one full sequence is required (less only slows the rollout down)
        for pool, group in ((within, True), (within, False), (above, True), (above, False)):
            for tp in tps:
                for util in pool:
                    cand = base.with_({ROLLOUT_TP: tp, GPU_UTIL: util})
                    found = _rollout_fits(state, cand, (tp, util, preset_util), extra, group)
                    if found:
                        return found
    return None


def _rollout_fits(
    state: Adaptation,
    cand: _Trial,
    knobs: tuple[int, float, float],
    extra: dict[str, Any],
    group: bool,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    tp, util, preset_util = knobs
    est = cand.estimate()
    stage, facts = est.stage("rollout"), est.rollout
    if stage is None or facts is None or facts.capacity_tokens is None or not _ok(stage, cand.gpu):
        return None
    need, why = _kv_need(cand.view, facts.max_model_len, group)
    if facts.capacity_tokens < need:
        return None
    gpu = cand.gpu
    resident = stage.total - (facts.pool_bytes or 0) / 2**30
    pool = f"gpu_memory_utilization {util:g} × {gpu:g} GiB"
    preset_tp = pos_int(state.base.get(ROLLOUT_TP)) or 1
    which = "the smallest TP above the preset's" if tp > preset_tp else "the largest TP up to the preset's"
    tp_reason = (
        f"{which} that fits: {facts.weights_bytes / 2**30:.1f} GiB of weights per GPU leave the KV cache of "
        f"{pool} {facts.capacity_tokens} tokens ≥ {need} ({why}); it divides {state.value(GPU_KEYS[0][0])} "
        f"GPUs per node{heads_clause(state.arch)}"
    )
    change = "lowered" if util < preset_util else "raised"
    util_reason = (
        f"{change} from {preset_util:g}: the rollout also holds {resident:.1f} GiB per GPU outside vLLM's pool "
        f"(the actor's resident training state, CUDA graphs, the process), so it peaks at {stage.total:.1f} GiB "
        f"(band up to {stage.high:.1f}) of {gpu:g} GiB"
        + (
            ", within the 10% margin"
            if util < preset_util
            else f"; at {preset_util:g} no TP holds {need} tokens"
        )
    )
    changes: dict[str, Any] = {ROLLOUT_TP: tp, GPU_UTIL: util, **extra}
    reasons = {ROLLOUT_TP: tp_reason, GPU_UTIL: util_reason}
    positions = state.arch.max_position_embeddings if state.arch else None
    for key, value in extra.items():
        reasons[key] = (
            f"null means the model's {positions} positions, more than the KV cache holds at any TP; sequences "
            f"here are at most {value} tokens (data.max_prompt_length + data.max_response_length)"
        )
    return changes, reasons


def _kv_need(view: ConfigView, max_len: int, samples: bool = True) -> tuple[int, str]:
    """Tokens the KV cache must hold: vLLM's longest sequence, and (``samples``) one prompt's samples at full
    length."""
    plan = batch_plan(view)
    group = (plan.n or 1) * (plan.max_seq_len or 0)
    if samples and group > max_len:
        return group, f"rollout.n {plan.n} × {plan.max_seq_len}-token sequences"
    return max_len, f"max_model_len {max_len}"

"""The out-of-memory checklist: concrete overrides for the stage that failed, ranked by the memory each frees."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.config_view import ARR, format_value
from verl_safe_launch.context import RuleContext
from verl_safe_launch.doctor.oom_log import HOST, KV_CACHE, RAY_TASK_KIND, ROLLOUT, WAKE_UP, OomEvent
from verl_safe_launch.doctor.oom_remedies import (
    BUDGET_DEFAULTS,
    dynamic_batching,
    expandable_segments,
    role_of,
)
from verl_safe_launch.doctor.postmortem import ESTIMATOR_STAGE, MARGIN
from verl_safe_launch.launch import STAGE_BY_NAME
from verl_safe_launch.memory import StageEstimate, estimate_memory, fit_knobs
from verl_safe_launch.provenance import Layer
from verl_safe_launch.rules import with_values

UTIL = f"{ARR}.rollout.gpu_memory_utilization"
TP = f"{ARR}.rollout.tensor_model_parallel_size"
MAX_MODEL_LEN = f"{ARR}.rollout.max_model_len"
OFFLOAD = (f"{ARR}.actor.fsdp_config.param_offload", f"{ARR}.actor.fsdp_config.optimizer_offload")
CHECKPOINTING = f"{ARR}.model.enable_gradient_checkpointing"
CHUNKING = f"{ARR}.actor.fsdp_config.entropy_from_logits_with_chunking"
ENTROPY_CHECKPOINTING = f"{ARR}.actor.fsdp_config.entropy_checkpointing"
DATALOADER = "data.dataloader_num_workers"
ENTROPY_ON = f"{ARR}.actor.calculate_entropy"
ENTROPY_COEFF = f"{ARR}.actor.entropy_coeff"
COMPILE = f"{ARR}.actor.fsdp_config.use_torch_compile"
RESPONSE = "data.max_response_length"
MIN_FREED_GIB = 0.05
MAX_FIT_TRIES = 12
FAR_SCALE = 4.0


@dataclass(frozen=True)
class Remedy:
    """One checklist item: the overrides, what they free and the stage's estimated peak after them (GiB)."""

    overrides: tuple[str, ...]
    freed_gib: float
    peak_gib: float
    why: str


@dataclass(frozen=True)
class Diagnosis:
    """What ran out, the knob that drives it, how the model compares with the measurement, and the remedies."""

    event: OomEvent
    stage: str | None
    knob: str | None
    knob_value: object
    estimated_gib: float | None
    scale: float
    remedies: tuple[Remedy, ...]
    notes: tuple[str, ...]
    fix: str = ""
    """A fix outside the run's config (another process holds the GPU), printed instead of a checklist."""
    pastable: bool = True
    """The checklist's items are overrides to paste (not so from the log alone: the config's values are unknown)."""


def measured_gib(event: OomEvent, record: Mapping[str, Any] | None) -> float | None:
    """The peak the failing process needed, at least: torch's in-use plus the failed allocation, or the record."""
    if event.needed_gib is not None:
        return event.needed_gib
    peak = (record or {}).get("peak_allocated_gib")
    return float(peak) if isinstance(peak, int | float) else None


def with_gpu(ctx: RuleContext, event: OomEvent) -> RuleContext:
    """Judge against the GPU in the message when the hardware was not declared."""
    if ctx.hardware.gpu_memory_gb is not None or event.total_gib is None:
        return ctx
    hardware = dataclasses.replace(ctx.hardware, gpu_memory_gb=round(event.total_gib, 1))
    return dataclasses.replace(ctx, hardware=hardware)


def _stage(ctx: RuleContext, name: str) -> StageEstimate | None:
    est = estimate_memory(ctx, margin=MARGIN)
    return None if est.missing else est.stage(name)


def diagnose(event: OomEvent, ctx: RuleContext, record: Mapping[str, Any] | None = None) -> Diagnosis:
    """The stage, its knob, the model scaled to the measurement, and the checklist ranked by memory freed."""
    ctx, notes = as_run(with_gpu(ctx, event), event)
    name = ESTIMATOR_STAGE.get(event.stage or "", ROLLOUT if event.stage == ROLLOUT else "")
    before = _stage(ctx, name) if name else None
    if event.kind == RAY_TASK_KIND:
        notes.append("torch's message is in the worker's log: pass the run directory to measure the failure")
    if event.own_pid is not None:
        notes.append(
            f"process {event.own_pid} in torch's list is the failing process itself ({event.in_use_gib:g} GiB in "
            "use; torch lists it by the driver's process id, as inside a container)"
        )
    if event.other_process_gib > (event.in_use_gib or 0.0):
        return _other_process(event, name, before)
    if before is None:
        notes.append(_unknown_stage(event, ctx))
        return Diagnosis(event, name or None, None, None, None, 1.0, (), tuple(notes))
    if event.kind == HOST:
        fix = (
            "host RAM per node: apply the checklist, or give the node more memory; Ray kills the newest worker "
            "above RAY_memory_usage_threshold (0.95 of host memory by default)"
        )
        remedies = _host_remedies(ctx, name)
        return Diagnosis(event, name, None, None, before.total, 1.0, remedies, tuple(notes), fix)
    measured = measured_gib(event, record)
    scale = 1.0
    micro = _micro_total(before)
    if measured is not None and measured > micro and before.batch_gib > 0:
        scale = (measured - (micro - before.batch_gib)) / before.batch_gib
        notes.append(
            f"the model says {micro:.1f} GiB for one micro batch of {name}, the process needed at least "
            f"{measured:.1f} GiB: activations and logits scaled ×{scale:.2f} to the measurement in every estimate"
        )
    if scale > FAR_SCALE:
        notes.append(f"×{scale:.1f} is far from 1: is the config given the one the run used?")
    knob = UTIL if event.kind in (KV_CACHE, WAKE_UP) else before.knob or _hook_knob(event, ctx)
    if event.kind == KV_CACHE:
        remedies = _kv_remedies(ctx, before)
    elif event.kind == WAKE_UP:
        remedies = _wake_remedies(ctx, before)
    else:
        remedies = _remedies(ctx, name, before, scale, knob, event.in_entropy, event)
    value = ctx.view.get(knob) if knob else None
    return Diagnosis(event, name, knob, value, before.total, scale, remedies, tuple(notes))


def as_run(ctx: RuleContext, event: OomEvent) -> tuple[RuleContext, list[str]]:
    """The config as the log shows it ran: a failure inside entropy_from_logits means the entropy was computed,
    over the full-vocabulary logits (not compiled away), whatever the config given says."""
    if not event.in_entropy:
        return ctx, []
    view = ctx.view
    changes: dict[str, object] = {}
    if view.get(ENTROPY_ON) is not True and view.get(ENTROPY_COEFF) in (0, 0.0, None):
        changes[ENTROPY_ON] = True
    if view.get(COMPILE) is not False and view.get(CHUNKING) is not True:
        changes[COMPILE] = False
    if not changes:
        return ctx, []
    shown = ", ".join(f"{k}={format_value(v)}" for k, v in changes.items())
    note = f"the traceback runs through entropy_from_logits over the full-vocabulary logits: estimated as run ({shown})"
    return dataclasses.replace(ctx, view=with_values(view, changes)), [note]


def _other_process(event: OomEvent, name: str, before: StageEstimate | None) -> Diagnosis:
    """Another process holds most of the GPU: no change to this run frees that memory."""
    held = ", ".join(f"process {pid} holds {gib:.1f} GiB" for pid, gib in event.others_gib)
    fix = (
        f"free GPU {event.gpu}: {held}, this process only {event.in_use_gib or 0.0:.1f} GiB. Stop the other "
        "process (nvidia-smi lists it; often an earlier run's trainer or vLLM server still alive) or run on "
        "other GPUs (CUDA_VISIBLE_DEVICES); shrinking this run's batches would not help"
    )
    estimated = before.total if before else None
    return Diagnosis(event, name or None, None, None, estimated, 1.0, (), (), fix)


def _wake_remedies(ctx: RuleContext, before: StageEstimate) -> tuple[Remedy, ...]:
    """vLLM maps its share back at wake-up beside what training still holds: a smaller share, checked to keep
    room for one sequence of max_model_len in the KV cache."""
    util = ctx.view.get(UTIL)
    if not isinstance(util, int | float) or isinstance(util, bool) or util <= 0.2:
        return ()
    out: list[Remedy] = []
    for step in (0.1, 0.2, 0.3):
        lower = round(float(util) - step, 2)
        if lower < 0.1:
            break
        after = estimate_memory(
            dataclasses.replace(ctx, view=with_values(ctx.view, {UTIL: lower})), margin=MARGIN
        )
        stage, rollout = after.stage(ROLLOUT), after.rollout
        if stage is None or rollout is None or (rollout.capacity_tokens or 0) < rollout.max_model_len:
            break
        why = (
            f"vLLM re-maps gpu_memory_utilization × the GPU at wake-up; KV cache ~{rollout.capacity_tokens} tokens "
            f"still holds one sequence of max_model_len {rollout.max_model_len}"
        )
        out.append(Remedy((_override(ctx, UTIL, lower),), before.total - stage.total, stage.total, why))
    return tuple(out)


def _host_remedies(ctx: RuleContext, name: str) -> tuple[Remedy, ...]:
    """Host RAM ran out: changes that free host memory per node, each checked to still fit the GPU."""
    est = estimate_memory(ctx, margin=MARGIN)
    gpu = ctx.hardware.gpu_memory_gb
    if est.host is None or gpu is None:
        return ()
    changes: list[tuple[Change, str]] = [
        ({OFFLOAD[1]: False}, "keep the optimizer states on the GPU instead of host memory"),
        ({OFFLOAD[0]: False}, "keep the parameters on the GPU instead of host memory"),
    ]
    workers = ctx.view.get(DATALOADER)
    if isinstance(workers, int) and workers > 2:
        changes.append(({DATALOADER: 2}, "fewer dataloader processes"))
    out: list[Remedy] = []
    for change, why in changes:
        if all(ctx.view.get(k) == v for k, v in change.items()):
            continue
        after = estimate_memory(dataclasses.replace(ctx, view=with_values(ctx.view, change)), margin=MARGIN)
        peak = max((s.total for s in after.stages), default=0.0)
        freed = est.host.total - (after.host.total if after.host else est.host.total)
        if freed >= MIN_FREED_GIB and peak * (1 + MARGIN) <= gpu:
            overrides = tuple(_override(ctx, k, v) for k, v in change.items())
            out.append(
                Remedy(overrides, freed, peak, why + f" (host RAM per node, GPU peak ~{peak:.1f} GiB)")
            )
    return tuple(sorted(out, key=lambda r: -r.freed_gib))


def _micro_total(stage: StageEstimate) -> float:
    """The stage's peak while a micro batch runs (the update also has end-of-backward and optimizer phases)."""
    return dict(stage.phases).get("micro batch", stage.total)


def scaled(stage: StageEstimate, scale: float) -> float:
    """The stage's peak with one micro batch's activations and logits scaled to a measurement."""
    return max(stage.total, _micro_total(stage) + (scale - 1.0) * stage.batch_gib)


def _hook_knob(event: OomEvent, ctx: RuleContext) -> str | None:
    spec = STAGE_BY_NAME.get(event.stage or "")
    if spec is None:
        return None
    knobs = spec.knobs({spec.dynamic: ctx.view.get(spec.dynamic)} if spec.dynamic else {})
    return knobs[0] if knobs else None


def _unknown_stage(event: OomEvent, ctx: RuleContext) -> str:
    if ctx.actor_arch is None:
        key = "actor_rollout_ref.model.path"
        path, prov = ctx.view.get(key), ctx.view.prov(key)
        if path and prov is not None and prov.source.layer is not Layer.VERL:
            return (
                f"no architecture for actor_rollout_ref.model.path={path}: no config.json there or in the local "
                "Hugging Face cache, and it is not in the bundled table; point model.path at a local model "
                "directory (with its config.json) or download the model to the cache"
            )
        return (
            "no architecture for the model: pass -c with the run's config or actor_rollout_ref.model.path=..."
        )
    if event.stage is None:
        return "the traceback names no worker stage: the checklist needs the stage (is the whole traceback in the log?)"
    return f"stage {event.stage} has no memory estimate"


Change = Mapping[str, object]


def _remedies(
    ctx: RuleContext,
    name: str,
    before: StageEstimate,
    scale: float,
    knob: str | None,
    entropy: bool = False,
    event: OomEvent | None = None,
) -> tuple[Remedy, ...]:
    start = scaled(before, scale)
    found: list[Remedy] = []
    fitted = _fitted(ctx, name, scale, knob, start)
    if fitted is not None:
        found.append(fitted)
    gpu = ctx.hardware.gpu_memory_gb or 0.0

    def peak_after(changes: Change) -> float | None:
        after = _stage_after(ctx, name, changes)
        peak = scaled(after, scale) if after is not None else None
        return peak if peak is not None and peak * (1 + MARGIN) <= gpu else None

    role_items = [dynamic_batching(ctx, name, start, peak_after)]
    if event is not None and name != ROLLOUT:  # vLLM's own allocator does not take expandable segments
        role_items.append(expandable_segments(ctx, event, start))
    found += [Remedy(*item) for item in role_items if item is not None and item[1] >= MIN_FREED_GIB]
    for changes, why in _candidates(ctx, name, entropy):
        after = _stage_after(ctx, name, changes)
        if after is None:
            continue
        peak = scaled(after, scale)
        if start - peak >= MIN_FREED_GIB:
            overrides = tuple(_override(ctx, k, v) for k, v in changes.items())
            found.append(Remedy(overrides, start - peak, peak, why))
    ranked = sorted(found, key=lambda r: -r.freed_gib)
    if entropy:  # the failure is in the entropy over the logits: its own switches come first
        ranked.sort(key=lambda r: not any(entropy_key(o) for o in r.overrides))
    return tuple(ranked)


def entropy_key(override: str) -> bool:
    return override.lstrip("+").startswith((CHUNKING + "=", ENTROPY_CHECKPOINTING + "="))


def _stage_after(ctx: RuleContext, name: str, changes: Change) -> StageEstimate | None:
    return _stage(dataclasses.replace(ctx, view=with_values(ctx.view, changes)), name)


def _fitted(ctx: RuleContext, name: str, scale: float, knob: str | None, start: float) -> Remedy | None:
    """The stage's micro batch (or token budget) below the failing value: the largest that fits the scaled model
    with the margin and passes every rule."""
    current = ctx.view.get(knob) if knob else None
    current = BUDGET_DEFAULTS.get(knob or "") if current is None else current
    gpu = ctx.hardware.gpu_memory_gb
    if (
        knob is None
        or gpu is None
        or not isinstance(current, int)
        or isinstance(current, bool)
        or current <= 1
    ):
        return None
    cap = current - 1
    for _ in range(MAX_FIT_TRIES):
        fit = next((f for f in fit_knobs(ctx, margin=MARGIN, cap={knob: cap}) if f.key == knob), None)
        if fit is None or fit.value is None:
            return None
        after = _stage_after(ctx, name, {knob: fit.value})
        if after is None:
            return None
        peak = scaled(after, scale)
        if peak * (1 + MARGIN) <= gpu:
            why = f"the largest value below {current} that fits with the {MARGIN:.0%} margin and passes every rule"
            return Remedy((str(fit.override),), start - peak, peak, why)
        if fit.value <= 1:
            return Remedy(
                (str(fit.override),), start - peak, peak, "the smallest; not enough alone: add more"
            )
        cap = fit.value - 1
    return None


def _kv_remedies(ctx: RuleContext, before: StageEstimate) -> tuple[Remedy, ...]:
    """The engine could not place its KV cache: give it a shorter longest sequence, more memory, or more GPUs."""
    est = estimate_memory(ctx, margin=MARGIN)
    facts = est.rollout
    if facts is None:
        return ()
    changes: list[tuple[Change, str]] = []
    if facts.max_model_len > facts.seq_len:
        changes.append(
            ({MAX_MODEL_LEN: facts.seq_len}, "the longest sequence the run makes (prompt + response)")
        )
    util = ctx.view.get(UTIL)
    if isinstance(util, int | float) and util < 0.9:
        changes.append(({UTIL: round(min(0.95, float(util) + 0.1), 2)}, "give the engine more of the GPU"))
    tp = ctx.view.get(TP)
    gpus = ctx.view.get("trainer.n_gpus_per_node")
    if isinstance(tp, int) and isinstance(gpus, int) and gpus % (tp * 2) == 0:
        changes.append(({TP: tp * 2}, "split the weights over more GPUs: more room for the KV cache on each"))
    out: list[Remedy] = []
    for change, why in changes:
        after = estimate_memory(dataclasses.replace(ctx, view=with_values(ctx.view, change)), margin=MARGIN)
        stage, rollout = after.stage(ROLLOUT), after.rollout
        if stage is None or rollout is None or rollout.capacity_tokens is None:
            continue
        detail = (
            f"{why}; KV cache ~{rollout.capacity_tokens} tokens for max_model_len {rollout.max_model_len}"
        )
        overrides = tuple(_override(ctx, k, v) for k, v in change.items())
        out.append(Remedy(overrides, before.total - stage.total, stage.total, detail))
    return tuple(out)


def _candidates(ctx: RuleContext, name: str, entropy: bool = False) -> list[tuple[Change, str]]:
    """The article's checklist as changes to this config (only those that change something)."""
    view = ctx.view
    out: list[tuple[Change, str]] = []
    role = role_of(name)
    if entropy and name == "actor update" and view.get(ENTROPY_CHECKPOINTING) is not True:
        out.append(({ENTROPY_CHECKPOINTING: True}, "recompute the entropy in backward instead of keeping it"))
    for whose, keys in role.offloads:
        if not all(view.get(k) is True for k in keys):
            out.append(({k: True for k in keys}, f"keep {whose} parameters and optimizer in CPU memory"))
    if role.checkpointing and view.get(role.checkpointing) is False:
        out.append(({role.checkpointing: True}, "recompute activations in backward"))
    if role.chunking and view.get(CHUNKING) is not True and name != ROLLOUT:
        out.append(({CHUNKING: True}, "compute entropy in chunks instead of over all logits"))
    response = view.get(RESPONSE)
    if isinstance(response, int) and response >= 256:
        out.append(
            (
                {RESPONSE: response // 2},
                "halve the response length (fewer tokens per sequence; changes what is trained)",
            )
        )
    util = view.get(UTIL)
    if isinstance(util, int | float) and util > 0.2:
        out.append(({UTIL: round(float(util) - 0.1, 2)}, "leave more memory outside the rollout engine"))
    tp = view.get(TP)
    gpus = view.get("trainer.n_gpus_per_node")
    if name == ROLLOUT and isinstance(tp, int) and isinstance(gpus, int) and gpus % (tp * 2) == 0:
        out.append(({TP: tp * 2}, "split the rollout weights over more GPUs"))
    return out


def _override(ctx: RuleContext, key: str, value: object) -> str:
    return f"{'' if key in ctx.view else '+'}{key}={format_value(value)}"

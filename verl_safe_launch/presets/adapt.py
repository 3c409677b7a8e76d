"""The adaptation of a preset to the real hardware: GPU counts, parallel sizes, batch sizes, micro batches."""

from __future__ import annotations

from verl_safe_launch.compose import Composed
from verl_safe_launch.context import RuleContext
from verl_safe_launch.inputs import GPU_KEYS, HardwareProfile, count_of, load_architecture
from verl_safe_launch.memory import fit_knobs
from verl_safe_launch.presets.catalog import ACTOR_SP, MICRO_KEYS, REF_SP
from verl_safe_launch.presets.memory_plan import memory_plan
from verl_safe_launch.presets.state import Adaptation, critic_arch, heads_clause
from verl_safe_launch.provenance import Write
from verl_safe_launch.rules import (
    ACTOR_MICRO,
    ACTOR_MINI,
    LOGPROB_MICRO,
    REF_MICRO,
    ROLLOUT_N,
    ROLLOUT_TP,
    TRAIN_BATCH,
    batch_plan,
    divisors,
    nearest,
    rollout_tp_ok,
    sync_steps,
    ulysses_heads_ok,
)


def adapt_preset(
    composed: Composed, name: str, profile: HardwareProfile, *, fit: bool = False
) -> tuple[Write, ...]:
    """Writes that move the preset's own values to what the hardware allows, each with its reason."""
    arch = load_architecture(composed.view.get("actor_rollout_ref.model.path"))
    state = Adaptation(composed.view, name, profile, arch)
    for step in (
        _gpu_counts,
        _ulysses,
        _rollout_tp,
        _train_batch,
        _mini_batch,
        _micro_divisors,
        memory_plan,
    ):
        step(state)
    _fit_micro(state, fit)
    return state.writes()


def _gpu_counts(state: Adaptation) -> None:
    for key, name, noun in GPU_KEYS:
        fact = getattr(state.profile, name)
        if fact is not None:
            state.change(
                key, fact.value, f"the hardware has {count_of(fact.value, noun)}: {fact.source.reason}"
            )


def _ulysses(state: Adaptation) -> None:
    current, gpus = state.value(ACTOR_SP), state.gpus
    if not state.owned(ACTOR_SP) or current is None or current <= 1 or gpus is None:
        return
    pick = max(d for d in range(1, current + 1) if gpus % d == 0 and ulysses_heads_ok(state.arch, d))
    reason = f"the largest size up to {current} that divides {gpus} GPUs{heads_clause(state.arch)}"
    state.change(ACTOR_SP, pick, reason)
    if state.owned(REF_SP) and state.value(REF_SP) == current:
        state.change(REF_SP, pick, reason + " (the same as the actor's)")


def _rollout_tp(state: Adaptation) -> None:
    current, gpn = state.value(ROLLOUT_TP), state.value(GPU_KEYS[0][0])
    if not state.owned(ROLLOUT_TP) or current is None or gpn is None:
        return
    valid = [d for d in divisors(gpn) if rollout_tp_ok(state.view, state.arch, d)]
    if current not in valid:
        pick = max([d for d in valid if d <= current] or [1])
        state.change(
            ROLLOUT_TP,
            pick,
            f"the largest TP up to {current} that divides {gpn} GPUs per node{heads_clause(state.arch)}",
        )


def _train_batch(state: Adaptation) -> None:
    current, n, gpus = state.value(TRAIN_BATCH), state.value(ROLLOUT_N), state.gpus
    if not state.owned(TRAIN_BATCH) or current is None or n is None or gpus is None:
        return
    steps = sync_steps(state.view) or 1
    mini = state.value(ACTOR_MINI) if not state.owned(ACTOR_MINI) else None

    def ok(b: int) -> bool:
        return (b * n) % gpus == 0 and b % steps == 0 and (mini is None or b >= mini)

    found = [] if ok(current) else nearest(current, ok)
    if not found:
        return  # nothing near fits: the batch rules report it with their fixes
    pick = found[0]
    state.change(
        TRAIN_BATCH,
        pick,
        f"{current} prompts × rollout.n {n} = {current * n} trajectories do not split evenly over "
        f"{gpus} GPUs; {pick} × {n} = {pick * n} do (the nearest such size)",
    )


def _mini_batch(state: Adaptation) -> None:
    current, n, batch = state.value(ACTOR_MINI), state.value(ROLLOUT_N), state.value(TRAIN_BATCH)
    dp = batch_plan(state.view).actor.dp
    if not state.owned(ACTOR_MINI) or None in (current, n, batch, dp):
        return
    assert current is not None and n is not None and batch is not None and dp is not None

    def ok(m: int) -> bool:
        return (m * n) % dp == 0 and m <= batch

    if ok(current):
        return
    found = nearest(current, ok, limit=batch)
    if found:
        pick = found[0]
        state.change(
            ACTOR_MINI,
            pick,
            f"{current} × rollout.n {n} = {current * n} trajectories do not split over {dp} data-parallel GPUs "
            f"(or exceed data.train_batch_size {batch}); {pick} × {n} = {pick * n} do (the nearest such size)",
        )


def _micro_divisors(state: Adaptation) -> None:
    plan = batch_plan(state.view)
    wholes = (
        (ACTOR_MICRO, plan.mini_per_gpu, "per-GPU mini batch"),
        (LOGPROB_MICRO, plan.logprob_rows, "per-GPU log-prob batch"),
        (REF_MICRO, plan.ref_rows, "per-GPU ref log-prob batch"),
    )
    for key, whole, what in wholes:
        current = state.value(key)
        if state.owned(key) and whole and current and whole % current:
            pick = max(d for d in divisors(whole) if d <= current)
            state.change(
                key, pick, f"the largest micro batch up to {current} that divides the {what} ({whole})"
            )


def _fit_micro(state: Adaptation, fit: bool) -> None:
    facts = state.profile.facts()
    owned = [key for key in MICRO_KEYS if state.owned(key) and state.value(key)]
    if facts.gpu_memory_gb is None or not owned:
        return
    ctx = RuleContext(state.view, state.arch, critic_arch(state), facts)
    cap = None if fit else {key: value for key in owned if (value := state.value(key))}
    for knob in fit_knobs(ctx, cap=cap):
        current = state.value(knob.key)
        if knob.key not in owned or knob.value is None or current is None:
            continue
        if fit or knob.value < current:
            state.change(knob.key, knob.value, knob.reason)

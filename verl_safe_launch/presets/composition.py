"""Composition with a preset: compose once, adapt the preset to the hardware, compose again."""

from __future__ import annotations

from dataclasses import replace

from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.context import RuleContext
from verl_safe_launch.inputs import (
    ComposeRequest,
    HardwareProfile,
    detect_hardware,
    hardware_fills,
    load_architecture,
    split_tool_tokens,
)
from verl_safe_launch.memory import fit_knobs
from verl_safe_launch.presets.adapt import adapt_preset
from verl_safe_launch.presets.catalog import AUTO, CRITIC_MICRO, choose_auto
from verl_safe_launch.provenance import Layer, Source, Write
from verl_safe_launch.rules import ACTOR_MICRO, ACTOR_MINI, batch_plan


def compose_for_launch(request: ComposeRequest, *, fit: bool = False) -> Composed:
    """Compose with hardware fills and, when a preset is named, with the preset adapted to the hardware."""
    _, tool = split_tool_tokens(request.overrides)
    profile = detect_hardware(tool)
    request = replace(request, fills=request.fills + hardware_fills(profile))
    return compose_with_preset(request, profile, fit=fit)


def compose_with_preset(request: ComposeRequest, profile: HardwareProfile, *, fit: bool = False) -> Composed:
    """Compose once, compute the preset's hardware adaptations, compose again with them (``adapted``)."""
    _, tool = split_tool_tokens(request.overrides)
    name = request.preset or (tool.preset[0] if tool.preset else None)
    if name is None:
        plain = compose(request)
        filled = _fill_missing(plain, profile) if fit else ()
        return compose(replace(request, adapted=request.adapted + filled)) if filled else plain
    where = tool.preset[1].describe() if tool.preset else None
    first: Composed | None = None
    if name == AUTO:
        if profile.gpus_per_node is None:
            first = compose(replace(request, preset="medium"))
        name = choose_auto(profile, first.view if first else None, where)[0]
        if name != "medium":
            first = None
    request = replace(request, preset=name)
    first = first or compose(request)
    adapted = adapt_preset(first, name, profile, fit=fit)
    result = compose(replace(request, adapted=request.adapted + adapted)) if adapted else first
    filled = _fill_missing(result, profile) if fit else ()
    if not filled:
        return result
    return compose(replace(request, adapted=request.adapted + adapted + filled))


def _fill_missing(composed: Composed, profile: HardwareProfile) -> tuple[Write, ...]:
    """``--fit``: every micro-batch knob nobody set (null) gets the fitted value, with the fit's reason."""
    facts = profile.facts()
    view = composed.view
    arch = load_architecture(view.get("actor_rollout_ref.model.path"))
    if facts.gpu_memory_gb is None or arch is None:
        return ()
    critic = load_architecture(view.get("critic.model.path"))
    ctx = RuleContext(view, arch, critic, facts)
    fits = fit_knobs(ctx)
    writes = [
        Write(knob.key, knob.value, Source(Layer.ADAPTED, reason=f"--fit: unset; {knob.reason}"))
        for knob in fits
        if knob.value is not None and view.get(knob.key) is None and not knob.add
    ]
    actor = next((k for k in fits if k.key == ACTOR_MICRO and k.value is not None), None)
    if (
        batch_plan(view).use_critic
        and view.get(CRITIC_MICRO) is None
        and actor is not None
        and critic is not None
        and critic.params <= arch.params
        and view.get("critic.ppo_mini_batch_size") == view.get(ACTOR_MINI)
    ):
        why = (
            f"--fit: unset; the actor's fitted micro batch ({actor.reason}): the critic trains on the same "
            f"per-GPU mini batch with a model no larger ({critic.params / 1e9:.1f}B ≤ {arch.params / 1e9:.1f}B)"
        )
        writes.append(Write(CRITIC_MICRO, actor.value, Source(Layer.ADAPTED, reason=why)))
    return tuple(writes)

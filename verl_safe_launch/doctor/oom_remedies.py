"""Checklist items that depend on the stage that failed: its own role's switches (the critic's offload is not the
actor's), dynamic batch sizing for a fixed micro batch, and expandable segments when the allocator fragmented."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from verl_safe_launch.config_view import ARR, format_value
from verl_safe_launch.context import RuleContext
from verl_safe_launch.doctor.oom_log import OomEvent
from verl_safe_launch.memory import CRITIC_V1_BUDGET, CRITIC_V1_BUDGET_DEFAULT, fit_knobs
from verl_safe_launch.rules import with_values

ACTOR_OFFLOAD = (f"{ARR}.actor.fsdp_config.param_offload", f"{ARR}.actor.fsdp_config.optimizer_offload")
BUDGET_DEFAULTS = {CRITIC_V1_BUDGET: CRITIC_V1_BUDGET_DEFAULT}
"""Token budgets verl's dataclasses default that its YAML does not list (the critic's, CriticConfig)."""
ALLOC_CONF = "ray_kwargs.ray_init.runtime_env.env_vars.PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


@dataclass(frozen=True)
class Role:
    """The switches of the engine that runs a stage, and of the engines whose shards share its GPU."""

    offloads: tuple[tuple[str, tuple[str, ...]], ...]
    """(whose, keys): the stage's own engine first, then the others resident while it runs."""
    checkpointing: str | None
    dynamic: tuple[str, str] | None
    """The stage's dynamic-batching switch and its token budget."""
    chunking: bool
    """The stage computes the entropy over the logits (the actor's log-probs and update)."""


ACTOR = ("the actor's", ACTOR_OFFLOAD)
BESIDE = ("the actor's (resident beside this stage)", ACTOR_OFFLOAD)
ROLES: dict[str, Role] = {
    "actor update": Role(
        (ACTOR,),
        f"{ARR}.model.enable_gradient_checkpointing",
        (f"{ARR}.actor.use_dynamic_bsz", f"{ARR}.actor.ppo_max_token_len_per_gpu"),
        True,
    ),
    "old log-prob": Role(
        (ACTOR,),
        None,
        (f"{ARR}.rollout.log_prob_use_dynamic_bsz", f"{ARR}.rollout.log_prob_max_token_len_per_gpu"),
        True,
    ),
    "ref log-prob": Role(  # the reference runs in the actor's worker: the actor's shards share its GPU
        (("the reference model's", (f"{ARR}.ref.fsdp_config.param_offload",)), BESIDE),
        None,
        (f"{ARR}.ref.log_prob_use_dynamic_bsz", f"{ARR}.ref.log_prob_max_token_len_per_gpu"),
        False,
    ),
    "critic": Role(  # the critic's own shards are needed on the GPU for its update; the actor's stay there too
        (("the critic's", ("critic.fsdp.param_offload", "critic.fsdp.optimizer_offload")), BESIDE),
        "critic.model.enable_gradient_checkpointing",
        None,  # the critic's micro batches are token budgets already (its knob)
        False,
    ),
}


def role_of(stage: str) -> Role:
    """The role whose switches act on ``stage`` (the actor's for the rollout: its shards share the GPU)."""
    return ROLES.get(stage, ROLES["actor update"])


MAX_TRIES = 12
Item = tuple[tuple[str, ...], float, float, str]
"""A checklist item: the overrides, GiB freed, the stage's peak after them, and why."""


def override(ctx: RuleContext, key: str, value: object) -> str:
    """``key=value``, with ``+`` when verl's YAML does not have the key."""
    return f"{'' if key in ctx.view else '+'}{key}={format_value(value)}"


def dynamic_batching(
    ctx: RuleContext, stage: str, start: float, peak_after: Callable[[Mapping[str, object]], float | None]
) -> Item | None:
    """A fixed micro batch turned into a token budget (verl packs sequences up to it, so short ones share a
    micro batch): the largest budget that fits and passes every rule, checked like every other item."""
    role = role_of(stage)
    if role.dynamic is None or ctx.view.get(role.dynamic[0]) is True:
        return None
    switch, budget_key = role.dynamic
    dynamic = dataclasses.replace(ctx, view=with_values(ctx.view, {switch: True}))
    cap: int | None = None
    for _ in range(MAX_TRIES):  # the model scaled to the failure may need a smaller budget than the fit alone
        fit = next(
            (f for f in fit_knobs(dynamic, cap={budget_key: cap} if cap else None) if f.key == budget_key),
            None,
        )
        if fit is None or fit.value is None:
            return None
        changes = {switch: True, budget_key: fit.value}
        peak = peak_after(changes)
        if peak is not None:
            break
        cap = fit.value * 3 // 4
    else:
        return None
    why = (
        f"a token budget instead of a fixed count of sequences: verl fills each micro batch up to {fit.value} tokens, "
        "so short responses no longer cost a full-length slot (the largest budget that fits and passes every rule)"
    )
    return tuple(override(ctx, k, v) for k, v in changes.items()), start - peak, peak, why


def expandable_segments(ctx: RuleContext, event: OomEvent, start: float) -> Item | None:
    """PyTorch's caching allocator held memory it could not hand out: growing segments instead of splitting
    them reclaims it (verl's engine workers turn this on after each weight sync; set it for the whole run)."""
    if not event.fragmented or str(ctx.view.get(ALLOC_CONF) or "").find("expandable_segments:True") >= 0:
        return None
    spare = event.unallocated_gib or 0.0
    why = (
        f"PyTorch held {spare:g} GiB reserved but unallocated when {event.tried_gib:g} GiB could not be "
        f"allocated ({event.free_gib:g} GiB free): fragmentation; expandable segments let the allocator reuse it"
    )
    return (override(ctx, ALLOC_CONF, EXPANDABLE),), spare, start - spare, why

"""Trainer-mode rules: the V1 modes' batch constraints, prompt fetching, and the legacy V0 chunking."""

from __future__ import annotations

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import verl_release
from verl_safe_launch.rules.fixes import KeyFix, divisor_fix, search_fix, set_fix
from verl_safe_launch.rules.kit import Draft, check, kv, not_positive, plan
from verl_safe_launch.rules.plan import (
    ACTOR_MINI,
    ROLLOUT_N,
    TRAIN_BATCH,
    TRAINER_MODE,
    V1,
    pos_int,
    uses_v1,
)


def first_step() -> str:
    """``verl 0.9.1 stops at the first training step``: the release judged, and when it finds out."""
    return f"{verl_release().name} stops at the first training step"


def sync_step_key(view: ConfigView) -> str:
    """The parameter_sync_step key of the configured V1 mode."""
    return f"trainer.v1.{view.get(TRAINER_MODE)}.parameter_sync_step"


@check("batch-v1-sync-step", "V1: train_batch_size divisible by the mode's parameter_sync_step", needs=V1)
def sync_step(ctx: RuleContext) -> list[Draft]:
    """PPOTrainer.step: ``train_batch_size must be divisible by parameter_sync_step``."""
    view = ctx.view
    key = sync_step_key(view)
    if not uses_v1(view) or key not in view:
        return []
    if skip := not_positive(view, (TRAIN_BATCH, key)):
        return skip
    batch, steps = view.get(TRAIN_BATCH), view.get(key)
    if batch is None or steps is None or batch % steps == 0:
        return []
    msg = f"{kv(view, TRAIN_BATCH)} is not divisible by {kv(view, key)}; {first_step()}"
    fixes = (search_fix(TRAIN_BATCH, batch, lambda b: b % steps == 0), divisor_fix(key, steps, batch))
    return [Draft((TRAIN_BATCH, key), msg, fixes)]


@check(
    "batch-v1-separate-async",
    "separate_async: train_batch_size = parameter_sync_step × ppo_mini_batch_size",
    needs=V1,
)
def separate_async(ctx: RuleContext) -> list[Draft]:
    """PPOTrainerSeparateAsync.__init__ (inside Ray)."""
    view = ctx.view
    if not uses_v1(view) or view.get(TRAINER_MODE) != "separate_async":
        return []
    key = sync_step_key(view)
    if skip := not_positive(view, (TRAIN_BATCH, key, ACTOR_MINI)):
        return skip
    batch, steps, mini = (pos_int(view.get(k)) for k in (TRAIN_BATCH, key, ACTOR_MINI))
    if batch is None or steps is None or mini is None or batch == steps * mini:
        return []
    msg = (
        f"{kv(view, TRAIN_BATCH)} must equal parameter_sync_step {steps} × ppo_mini_batch_size {mini} = "
        f"{steps * mini} in separate_async mode; {verl_release().name} stops when the trainer starts"
    )
    fixes = [set_fix(TRAIN_BATCH, steps * mini)]
    if batch % steps == 0:
        fixes.append(set_fix(ACTOR_MINI, batch // steps))
    if batch % mini == 0:
        fixes.append(set_fix(key, batch // mini))
    return [Draft((TRAIN_BATCH, key, ACTOR_MINI), msg, tuple(fixes))]


@check(
    "layout-separate-async-pool",
    "separate_async: a standalone rollout pool and a non-naive checkpoint engine",
    needs=V1,
)
def separate_async_pool(ctx: RuleContext) -> list[Draft]:
    """PPOTrainerSeparateAsync.__init__: rollout.nnodes/n_gpus_per_node > 0 and checkpoint_engine.backend."""
    view = ctx.view
    if not uses_v1(view) or view.get(TRAINER_MODE) != "separate_async":
        return []
    r = f"{ARR}.rollout"
    drafts: list[Draft] = []
    late = f"{verl_release().name} stops when the trainer starts"
    for name, value in (("nnodes", 1), ("n_gpus_per_node", view.get("trainer.n_gpus_per_node") or 8)):
        key = f"{r}.{name}"
        if pos_int(view.get(key)) is None:
            msg = f"{kv(view, key)}: separate_async runs the rollout on its own pool, which needs {name} > 0; {late}"
            drafts.append(Draft((key,), msg, (set_fix(key, value),)))
    backend = f"{r}.checkpoint_engine.backend"
    if view.get(backend) == "naive":
        msg = f"{kv(view, backend)} cannot sync weights to a separate rollout pool (use nccl, nixl, mooncake); {late}"
        drafts.append(Draft((backend,), msg, (KeyFix(backend, ("nccl", "nixl", "mooncake")),)))
    return drafts


def gen_batch_forced_to_one(view: ConfigView) -> bool:
    """Group filtering or synchronous refill make verl fetch prompts one at a time."""
    return bool(view.get("algorithm.filter_groups.enable")) or bool(
        view.get("trainer.v1.sampler.sync_refill_failed_groups")
    )


@check("batch-gen-batch-size", "V1: train_batch_size is a multiple of data.gen_batch_size", needs=V1)
def gen_batch_size(ctx: RuleContext) -> list[Draft]:
    """PPOTrainer._next_train_batch: ``num_prompts must be a positive multiple of gen_batch_size``."""
    view, key = ctx.view, "data.gen_batch_size"
    if not uses_v1(view) or view.get(key) is None or gen_batch_forced_to_one(view):
        return []
    if skip := not_positive(view, (TRAIN_BATCH, key)):
        return skip
    batch, gen = view.get(TRAIN_BATCH), view.get(key)
    if batch % gen == 0:
        return []
    msg = f"{kv(view, TRAIN_BATCH)} is not a multiple of {kv(view, key)}: verl fetches prompts in whole "
    msg += f"gen_batch_size chunks; {first_step()}"
    fixes = (divisor_fix(key, gen, batch), search_fix(TRAIN_BATCH, batch, lambda b: b % gen == 0))
    return [Draft((TRAIN_BATCH, key), msg, fixes)]


TRAINER_MODES = ("sync", "colocate_async", "separate_async")


@check("verl-trainer-mode", "trainer.v1.trainer_mode is sync, colocate_async or separate_async", needs=V1)
def trainer_mode(ctx: RuleContext) -> list[Draft]:
    """The V1 trainer class lookup (inside Ray)."""
    key = "trainer.v1.trainer_mode"
    if not uses_v1(ctx.view) or ctx.view.get(key) in TRAINER_MODES:
        return []
    msg = f"{kv(ctx.view, key)} is not a V1 trainer mode ({', '.join(TRAINER_MODES)}); {verl_release().name} looks it up inside Ray"
    return [Draft((key,), msg, (KeyFix(key, TRAINER_MODES),))]


@check(
    "batch-v0-agent-chunks",
    "legacy trainer: train_batch_size × n divisible by rollout.agent.num_workers",
    needs=(f"config:{ARR}.rollout.agent.num_workers",),
)
def v0_agent_chunks(ctx: RuleContext) -> list[Draft]:
    """DataProto.chunk in the V0 agent loop: ``only support equal chunk``."""
    view, p = ctx.view, plan(ctx)
    key = f"{ARR}.rollout.agent.num_workers"
    if p.v1 or view.get(f"{ARR}.rollout.mode", "async") != "async":
        return []  # releases with a sync rollout mode split over agent workers only in async mode
    if skip := not_positive(view, (TRAIN_BATCH, ROLLOUT_N, key)):
        return skip
    workers = view.get(key)
    if p.trajectories is None or p.trajectories % workers == 0:
        return []
    msg = (
        f"{kv(view, key)} does not divide the {p.trajectories} sequences per step (= train_batch_size "
        f"{p.prompts} × rollout.n {p.n}) that the legacy trainer splits over its agent workers; {first_step()}"
    )
    fixes = (
        divisor_fix(key, workers, p.trajectories),
        search_fix(TRAIN_BATCH, p.prompts, lambda b: b * (p.n or 1) % workers == 0),
    )
    return [Draft((key, TRAIN_BATCH, ROLLOUT_N, "trainer.use_v1"), msg, fixes)]


RULES: tuple[Rule[RuleContext], ...] = (
    sync_step,
    separate_async,
    separate_async_pool,
    gen_batch_size,
    trainer_mode,
    v0_agent_chunks,
)

"""Rollout and cluster rules: replica layout vs GPUs and nodes, backend settings, extra pools, Ray CPUs."""

from __future__ import annotations

from verl_safe_launch.config_view import ARR, ConfigView, format_value, is_missing
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule, Severity
from verl_safe_launch.inputs import max_model_len_paths, registered_names, verl_release
from verl_safe_launch.rules.engines import rollout_tp_ok
from verl_safe_launch.rules.fixes import KeyFix, divisors, largest_first_at_most, set_fix
from verl_safe_launch.rules.kit import Draft, check, kv, not_positive, plan, skipped
from verl_safe_launch.rules.plan import (
    GPUS_PER_NODE,
    NNODES,
    ROLLOUT_DP,
    ROLLOUT_PP,
    ROLLOUT_TP,
    TRAINER_MODE,
    BatchPlan,
    pos_int,
    product,
    uses_v1,
)

R = f"{ARR}.rollout"
LAYOUT = (ROLLOUT_TP, ROLLOUT_DP, ROLLOUT_PP)
ENGINE_READS = (f"{R}.name", f"{ARR}.model.path")
"""What a TP fix also reads: the sizes it lists are those the rollout engine accepts for the model."""


def after_load() -> str:
    """``verl 0.9.1 only finds out after the actor is loaded on the GPUs``: the release judged, and when it finds out."""
    return f"{verl_release().name} only finds out after the actor is loaded on the GPUs"


def replica() -> str:
    """``verl 0.9.1 only finds out when it starts the rollout replicas``: the release judged, and when it finds out."""
    return f"{verl_release().name} only finds out when it starts the rollout replicas"


def tp_fix(ctx: RuleContext, p: BatchPlan, ok_world: list[int]) -> KeyFix | None:
    """Rollout tensor parallel sizes whose replica world (tp·dp·pp) is in ``ok_world`` and that the rollout
    engine accepts for the model (``rollout_tp_ok``)."""
    rest = product(p.rollout_dp, p.rollout_pp)
    if not rest:
        return None
    sizes = {w // rest for w in ok_world if w % rest == 0}
    valid = sorted(tp for tp in sizes if rollout_tp_ok(ctx.view, ctx.actor_arch, tp))
    if not valid:
        return None
    return KeyFix(ROLLOUT_TP, tuple(largest_first_at_most(p.rollout_tp or 1, valid)), complete=True)


def world_text(p: BatchPlan) -> str:
    """``tensor × data × pipeline parallel = 3 × 1 × 1 = 3 GPUs per replica``."""
    return (
        f"rollout tensor × data × pipeline parallel = {p.rollout_tp} × {p.rollout_dp} × {p.rollout_pp} = "
        f"{p.rollout_world} GPUs per replica"
    )


def hybrid(view: ConfigView) -> bool:
    """True when rollout replicas share the trainer's GPUs (every mode but separate_async without hybrid)."""
    if uses_v1(view) and view.get(TRAINER_MODE) == "separate_async":
        return view.get(f"{ARR}.hybrid_engine") is not False
    return True


@check(
    "layout-rollout-world", "rollout tp × dp × pp divides the GPUs it runs on", needs=("code:rollout-world",)
)
def rollout_world(ctx: RuleContext) -> list[Draft]:
    """ActorRolloutRefWorker.init_model: ``rollout world_size ... is not divisible by infer_world_size``."""
    view, p = ctx.view, plan(ctx)
    if skip := not_positive(view, LAYOUT):
        return skip
    world, drafts = p.rollout_world, []
    pools = [(p.gpus, (GPUS_PER_NODE, NNODES), "trainer")] if hybrid(view) else []
    if uses_v1(view) and view.get(TRAINER_MODE) == "separate_async":
        pools.append((p.rollout_gpus, (f"{R}.n_gpus_per_node", f"{R}.nnodes"), "standalone rollout"))
    for gpus, keys, name in pools:
        if world and gpus and gpus % world:
            msg = f"{world_text(p)} does not divide the {gpus} GPUs of the {name} pool; {after_load()}"
            drafts.append(Draft((*LAYOUT, *keys), msg, (tp_fix(ctx, p, divisors(gpus)),), reads=ENGINE_READS))
    return drafts


@check(
    "layout-rollout-nodes",
    "a rollout replica fills whole nodes, or fits in one",
    needs=("code:rollout-nodes",),
)
def rollout_nodes(ctx: RuleContext) -> list[Draft]:
    """RolloutReplica: ``world_size must be divisible by gpus_per_node``."""
    view, p = ctx.view, plan(ctx)
    gpn_key = GPUS_PER_NODE if hybrid(view) else f"{R}.n_gpus_per_node"
    gpn, world = pos_int(view.get(gpn_key)), p.rollout_world
    if gpn is None or world is None or world % min(gpn, world) == 0:
        return []
    msg = f"{world_text(p)} spans nodes of {gpn} GPUs unevenly ({world} is not a multiple of {gpn}); {replica()}"
    ok_world = [w for w in range(1, 8 * gpn + 1) if w % min(gpn, w) == 0 and (not p.gpus or p.gpus % w == 0)]
    return [Draft((*LAYOUT, gpn_key), msg, (tp_fix(ctx, p, ok_world),), reads=ENGINE_READS)]


@check("layout-rollout-vllm-dp", "vLLM with rollout data parallel: tensor parallel divides the GPUs per node")
def rollout_vllm_dp(ctx: RuleContext) -> list[Draft]:
    """vLLM server: ``gpus_per_node should be divisible by tensor_model_parallel_size``."""
    view, p = ctx.view, plan(ctx)
    gpn = pos_int(view.get(GPUS_PER_NODE))
    if (
        view.get(f"{R}.name") != "vllm"
        or not p.rollout_dp
        or p.rollout_dp < 2
        or None in (gpn, p.rollout_world)
    ):
        return []
    local = min(gpn or 1, p.rollout_world or 1)
    if not p.rollout_tp or local % p.rollout_tp == 0:
        return []
    msg = f"{kv(view, ROLLOUT_TP)} does not divide the {local} GPUs a vLLM data-parallel replica has per node; {replica()}"
    ok = [tp for tp in divisors(local) if rollout_tp_ok(view, ctx.actor_arch, tp)]
    fix = KeyFix(ROLLOUT_TP, tuple(largest_first_at_most(p.rollout_tp, ok)), complete=True) if ok else None
    return [Draft((ROLLOUT_TP, ROLLOUT_DP, GPUS_PER_NODE), msg, (fix,), reads=ENGINE_READS)]


@check(
    "layout-rollout-pp",
    "rollout pipeline parallel is 1 (vllm, sglang, trtllm do not implement more)",
    needs=("code:rollout-config",),
)
def rollout_pp(ctx: RuleContext) -> list[Draft]:
    """RolloutConfig.__post_init__: ``not implemented pipeline_model_parallel_size > 1 yet``."""
    view = ctx.view
    pp = pos_int(view.get(ROLLOUT_PP))
    if not pp or pp == 1 or view.get(f"{R}.name") not in ("vllm", "sglang", "trtllm"):
        return []
    msg = f"{kv(view, ROLLOUT_PP)}: rollout {format_value(view.get(f'{R}.name'))} does not implement pipeline parallel; {after_load()}"
    return [Draft((ROLLOUT_PP, f"{R}.name"), msg, (set_fix(ROLLOUT_PP, 1),))]


@check(
    "layout-rollout-ep",
    "rollout expert parallel = tensor × data parallel (not trtllm)",
    needs=("code:rollout-config",),
)
def rollout_ep(ctx: RuleContext) -> list[Draft]:
    """RolloutConfig.__post_init__: ``expert_parallel_size must be equal to tp * dp``."""
    view, p = ctx.view, plan(ctx)
    key = f"{R}.expert_parallel_size"
    ep = pos_int(view.get(key))
    if view.get(f"{R}.name") == "trtllm" or not ep or ep == 1:
        return []
    want = product(p.rollout_tp, p.rollout_dp)
    if want is None or ep == want:
        return []
    msg = f"{kv(view, key)} must equal rollout tensor × data parallel = {p.rollout_tp} × {p.rollout_dp} = {want}; {after_load()}"
    return [Draft((key, ROLLOUT_TP, ROLLOUT_DP), msg, (KeyFix(key, (want, 1)),))]


@check("layout-rollout-max-model-len", "rollout.max_model_len ≤ the model's max_position_embeddings")
def max_model_len(ctx: RuleContext) -> list[Draft]:
    """vLLM and SGLang servers: ``max_model_len ... should be less than or equal to max_position_embeddings``."""
    view, key = ctx.view, f"{R}.max_model_len"
    value = pos_int(view.get(key))
    if value is None or view.get(f"{R}.name") not in ("vllm", "sglang"):
        return []
    arch = ctx.actor_arch
    if arch is None:
        return [
            skipped((key, f"{ARR}.model.path"), f"no config.json found for {kv(view, f'{ARR}.model.path')}")
        ]
    if value <= arch.max_position_embeddings:
        return []
    paths = max_model_len_paths() if view.get(f"{R}.name") == "vllm" else {}
    if paths and not any(paths.values()):
        return []  # no vLLM module of this verl hands the engine the key: it derives the length itself
    limit = arch.max_position_embeddings
    msg = f"{kv(view, key)} exceeds {arch.name}'s max_position_embeddings {limit} (from {arch.source}); {replica()}"
    if paths and not all(paths.values()):
        reads = ", ".join(sorted(name for name, used in paths.items() if used))
        others = ", ".join(sorted(name for name, used in paths.items() if not used))
        msg += (
            f"; this verl hands it to vLLM only in {reads}, and {others} derives the length from the prompt and "
            "response lengths: which one runs depends on the vLLM version installed, which is not read here"
        )
        return [Draft((key, f"{ARR}.model.path"), msg, (set_fix(key, limit),), severity=Severity.WARNING)]
    return [Draft((key, f"{ARR}.model.path"), msg, (set_fix(key, limit),))]


ROLLOUT_NAMES = ("vllm", "sglang", "trtllm")


@check(
    "verl-rollout-name", "rollout.name is a rollout backend of the verl in use (vllm, sglang, trtllm in 0.9)"
)
def rollout_name(ctx: RuleContext) -> list[Draft]:
    """The rollout backend verl looks up when the workers start (``Rollout X with mode async not found``)."""
    key = f"{ARR}.rollout.name"
    name = ctx.view.get(key)
    known = registered_names().get("rollout", frozenset())
    names = tuple(sorted(known, key=lambda n: (ROLLOUT_NAMES.index(n) if n in ROLLOUT_NAMES else 9, n)))
    if not names or name in names or is_missing(name):
        return []  # an unset '???' is the audit's missing-required finding; no table: not judged
    what = "is not set" if name is None else f"is {format_value(name)}, which is not a rollout backend"
    has = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    msg = f"{key} {what}: {verl_release().name} has {has}, and only looks it up after Ray is up"
    return [Draft((key,), msg, (KeyFix(key, names),))]


@check(
    "verl-rollout-config",
    "RolloutConfig: async mode; disaggregation on vllm/sglang; MoE TP on trtllm only",
    needs=("code:rollout-config",),
)
def rollout_config(ctx: RuleContext) -> list[Draft]:
    """RolloutConfig.__post_init__, which verl first runs inside the workers."""
    view = ctx.view
    r = f"{ARR}.rollout"
    name, drafts = view.get(f"{r}.name"), []
    release = verl_release()
    late = f"{release.name} stops when the workers build the rollout"
    if view.get(f"{r}.mode") == "sync" and release.has("code:rollout-sync-removed"):
        msg = f"{kv(view, f'{r}.mode')}: the sync rollout mode has been removed; {late}"
        drafts.append(Draft((f"{r}.mode",), msg, (set_fix(f"{r}.mode", "async"),)))
    disaggregated = view.get(f"{r}.disaggregation.enabled") and release.has("code:rollout-disaggregation")
    if disaggregated and name not in ("sglang", "vllm"):
        msg = f"{kv(view, f'{r}.disaggregation.enabled')} requires rollout.name sglang or vllm, not {format_value(name)}; {late}"
        fixes = (KeyFix(f"{r}.name", ("vllm", "sglang")), set_fix(f"{r}.disaggregation.enabled", False))
        drafts.append(Draft((f"{r}.disaggregation.enabled", f"{r}.name"), msg, fixes))
    moe = pos_int(view.get(f"{r}.moe_tensor_parallel_size"))
    if moe and moe > 1 and name != "trtllm" and release.has("code:rollout-moe-tp"):
        msg = f"{kv(view, f'{r}.moe_tensor_parallel_size')} is only supported by trtllm, not {format_value(name)}; {late}"
        drafts.append(
            Draft(
                (f"{r}.moe_tensor_parallel_size", f"{r}.name"),
                msg,
                (set_fix(f"{r}.moe_tensor_parallel_size", 1),),
            )
        )
    return drafts


RULES: tuple[Rule[RuleContext], ...] = (
    rollout_world,
    rollout_nodes,
    rollout_vllm_dp,
    rollout_pp,
    rollout_ep,
    max_model_len,
    rollout_name,
    rollout_config,
)

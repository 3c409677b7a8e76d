"""Cluster rules: reward and teacher GPU pools, GPUs the cluster must have, CPUs Ray needs for the V1 trainer."""

from __future__ import annotations

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule, Severity
from verl_safe_launch.inputs import verl_release
from verl_safe_launch.rules.fixes import KeyFix, set_fix
from verl_safe_launch.rules.kit import Draft, check, kv, plan, skipped
from verl_safe_launch.rules.plan import GPUS_PER_NODE, NNODES, V1, pos_int, product, uses_v1, varying
from verl_safe_launch.rules.resources import cpu_need, gpu_need

RM = "reward.reward_model"
DIST = "distillation"


def starts() -> str:
    """``verl 0.9.1 only finds out when it builds the resource pools``: the release judged, and when it finds out."""
    return f"{verl_release().name} only finds out when it builds the resource pools"


CPU_KEY = "ray_kwargs.ray_init.num_cpus"
UNITS_KEY = "transfer_queue.backend.SimpleStorage.num_data_storage_units"


def _pool_sizes(view: ConfigView, prefix: str, what: str) -> list[Draft]:
    drafts: list[Draft] = []
    for name, fallback in (("n_gpus_per_node", view.get(GPUS_PER_NODE) or 8), ("nnodes", 1)):
        key = f"{prefix}.{name}"
        if pos_int(view.get(key)) is None:
            msg = f"{kv(view, key)}: {what} needs its own GPU pool, so {name} must be > 0; {starts()}"
            drafts.append(Draft((key,), msg, (set_fix(key, fallback),)))
    return drafts


def reward_world(view: ConfigView, gpus: int | None) -> int | None:
    """GPUs the reward model's servers run on: its own pool, or the trainer's when colocated."""
    if view.get(f"{RM}.enable_resource_pool"):
        return product(pos_int(view.get(f"{RM}.n_gpus_per_node")), pos_int(view.get(f"{RM}.nnodes")))
    return gpus


@check("layout-reward-pool", "reward model: its pool has GPUs, at least one replica's worth")
def reward_pool(ctx: RuleContext) -> list[Draft]:
    """V1 resource pools (``reward_model.n_gpus_per_node must be greater than 0``) and the reward servers."""
    view, p = ctx.view, plan(ctx)
    drafts = (
        _pool_sizes(view, RM, "reward.reward_model.enable_resource_pool=true")
        if view.get(f"{RM}.enable_resource_pool")
        else []
    )
    if drafts or not view.get(f"{RM}.enable"):
        return drafts
    layout = [
        f"{RM}.rollout.{k}"
        for k in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")
    ]
    world, gpus = product(*(pos_int(view.get(k)) for k in layout)), reward_world(view, p.gpus)
    if world is None or gpus is None or gpus >= world:
        return drafts
    msg = (
        f"the reward model needs {world} GPUs per replica (tp × dp × pp) but its pool has {gpus}; {starts()}"
    )
    return [Draft((*layout, f"{RM}.enable_resource_pool"), msg, (set_fix(layout[0], 1),))]


def teacher_layouts(view: ConfigView) -> dict[str, tuple[int | None, int | None]]:
    """Teacher name → (num_replicas, GPUs per replica) from ``distillation.teacher_models``."""
    names = {k.split(".")[2] for k in view.subtree(f"{DIST}.teacher_models") if k.count(".") >= 3}
    out: dict[str, tuple[int | None, int | None]] = {}
    for name in sorted(names):
        base = f"{DIST}.teacher_models.{name}"
        sizes = (
            pos_int(view.get(f"{base}.inference.{k}_parallel_size"))
            for k in ("tensor_model", "data", "pipeline_model")
        )
        replicas = view.get(f"{base}.num_replicas")
        out[name] = (replicas if isinstance(replicas, int) else None, product(*sizes))
    return out


@check("layout-teacher-pool", "distillation: the teacher pool has GPUs and the teachers fill it exactly")
def teacher_pool(ctx: RuleContext) -> list[Draft]:
    """DistillationConfig.__post_init__ and the V1 teacher pool."""
    view = ctx.view
    if not view.get(f"{DIST}.enabled"):
        return []
    if drafts := _pool_sizes(view, DIST, "distillation"):
        return drafts
    pool = product(pos_int(view.get(f"{DIST}.n_gpus_per_node")), pos_int(view.get(f"{DIST}.nnodes")))
    teachers = teacher_layouts(view)
    keys = (f"{DIST}.n_gpus_per_node", f"{DIST}.nnodes")
    if len(teachers) == 1:
        per = next(iter(teachers.values()))[1]
        if pool and per and pool % per:
            msg = f"the teacher's {per} GPUs per replica (tp × dp × pp) do not divide the {pool}-GPU teacher pool; {starts()}"
            return [Draft(keys, msg, (set_fix(keys[0], per),))]
        return []
    named = {name: layout for name, layout in teachers.items() if name != "teacher_model"}
    if any(r is None or w is None for r, w in named.values()):
        return []  # a teacher added with '+' takes its sizes from verl's dataclass defaults, not read here
    used = sum((r or 0) * (w or 0) for r, w in named.values())
    if pool is None or used == pool:
        return []
    msg = (
        f"the teachers use {used} GPUs (num_replicas × tp × dp × pp, summed) but the teacher pool has {pool}"
    )
    gpn = pos_int(view.get(keys[0])) or 1
    fix = (
        set_fix(keys[1], used // gpn)
        if used and used % gpn == 0
        else set_fix(keys[0], used, (f"{keys[1]}=1",))
    )
    return [Draft(keys, f"{msg}; {starts()}", (fix,))]


@check("layout-gpus-available", "the GPUs every pool asks for exist on the machines")
def gpus_available(ctx: RuleContext) -> list[Draft]:
    """ResourcePoolManager: ``Total available GPUs X is less than total desired GPUs Y``."""
    view, hw = ctx.view, ctx.hardware
    keys = (GPUS_PER_NODE, NNODES)
    if hw.nodes is None or hw.gpus_per_node is None:
        missing = [name for name in ("nodes", "gpus_per_node") if getattr(hw, name) is None]
        what = " and ".join(f"hardware.{name}" for name in missing)
        return [skipped(keys, f"{what} {'is' if len(missing) == 1 else 'are'} unknown (declare {what})")]
    have, need = hw.nodes * hw.gpus_per_node, gpu_need(view).total
    if need is None or need <= have:
        return []
    msg = f"the run asks Ray for {need} GPUs (trainer and extra pools) but the machines have {have} "
    msg += f"({hw.nodes} × {hw.gpus_per_node}); {starts()}"
    return [Draft(keys, msg, (_shrink(view, NNODES, have), _shrink(view, GPUS_PER_NODE, have)))]


def _shrink(view: ConfigView, key: str, have: int) -> KeyFix | None:
    """The largest smaller value of ``key`` with which every pool fits on the machines."""
    current, at = pos_int(view.get(key)), varying(view, key)
    if current is None:
        return None
    for value in range(current - 1, 0, -1):
        changed = at(value)
        need = gpu_need(changed).total
        if need is not None and need <= have:
            return KeyFix(key, (value,))
    return None


@check(
    "layout-ray-cpus",
    "V1: Ray has CPUs for the GPU bundles and the TransferQueue actors",
    needs=V1,
)
def ray_cpus(ctx: RuleContext) -> list[Draft]:
    """With too few logical CPUs the TransferQueue start-up (tq.init) waits forever, without an error."""
    view = ctx.view
    if not uses_v1(view) or (pos_int(view.get(NNODES)) or 1) > 1:
        return []
    cpus = cpu_need(view)
    need, have = cpus.total, view.get(CPU_KEY)
    formula = cpus.describe().split(" ", 1)[1].strip("()")
    keys = (CPU_KEY, GPUS_PER_NODE, UNITS_KEY)
    if have is None:
        return _counted_cpus(ctx, need, formula)
    if pos_int(have) is None or have >= need:
        return []
    msg = f"{kv(view, CPU_KEY)} is below the {need} logical CPUs the V1 trainer reserves ({formula}); "
    msg += HANGS
    return [Draft(keys, msg, (set_fix(CPU_KEY, need),))]


HANGS = "the TransferQueue start-up then waits forever without an error"


def _counted_cpus(ctx: RuleContext, need: int, formula: str) -> list[Draft]:
    """``num_cpus`` null: the Ray that ``ray.init()`` starts counts the machine's CPUs; judge that count."""
    hw, keys = ctx.hardware, (CPU_KEY, GPUS_PER_NODE, UNITS_KEY)
    address = ctx.view.get("ray_kwargs.ray_init.address")
    joins = f"ray_kwargs.ray_init.address={address} joins that cluster" if address else hw.ray_joins
    head = f"{CPU_KEY} is null, so Ray counts the machine's CPUs; the V1 trainer needs {need} ({formula})"
    if hw.ray_by:
        return [skipped(keys, f"{head}; {hw.ray_by} starts Ray itself and sets num_cpus to at least that")]
    if joins:
        return [skipped(keys, f"{head}, and {joins}, whose CPUs are not known here")]
    if hw.cpus_per_node is None:
        return [skipped(keys, f"{head}; declare hardware.cpus_per_node to check it")]
    if hw.cpus_per_node >= need:
        return []
    where = "Ray on this machine" if hw.cpus_certain else "a Ray that verl starts on this machine"
    msg = f"{CPU_KEY} is null, so {where} counts {hw.cpus_per_node} CPUs ({hw.cpus_from}), below the {need} "
    msg += f"logical CPUs the V1 trainer reserves ({formula}); {HANGS}"
    severity = None if hw.cpus_certain else Severity.WARNING
    return [Draft(keys, msg, (set_fix(CPU_KEY, need),), severity=severity)]


RULES: tuple[Rule[RuleContext], ...] = (
    reward_pool,
    teacher_pool,
    gpus_available,
    ray_cpus,
)

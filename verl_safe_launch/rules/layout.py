"""Training-side parallel layout rules: Megatron TP×PP×CP and VPP grouping, Ulysses GPUs, heads and padding."""

from __future__ import annotations

from collections.abc import Iterator

from verl_safe_launch.config_view import ARR, ConfigView, format_value
from verl_safe_launch.context import Architecture, RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import verl_release
from verl_safe_launch.rules.fixes import KeyFix, divisors, largest_first_at_most, set_fix
from verl_safe_launch.rules.kit import Draft, check, kv, plan, skipped, stops
from verl_safe_launch.rules.mcore import megatron_tp_ok
from verl_safe_launch.rules.plan import (
    ACTOR_MICRO,
    GPUS_PER_NODE,
    LOGPROB_MICRO,
    NNODES,
    REF_MICRO,
    BatchPlan,
    RoleLayout,
    exact,
    pos_int,
    product,
)


def init() -> str:
    """``verl 0.9.1 only finds out when the workers build the models``: the release judged, and when it finds out."""
    return f"{verl_release().name} only finds out when the workers build the models"


def first_step() -> str:
    """``verl 0.9.1 only finds out at the first training step``: the release judged, and when it finds out."""
    return f"{verl_release().name} only finds out at the first training step"


def used_roles(p: BatchPlan) -> Iterator[RoleLayout]:
    """The training roles that run: the actor, the reference model if needed, the critic if needed."""
    yield p.actor
    if p.use_ref:
        yield p.ref
    if p.use_critic:
        yield p.critic


def distinct(p: BatchPlan, layout: RoleLayout) -> bool:
    """False for a reference layout identical to the actor's (reported once, on the actor)."""
    if layout.role != "ref":
        return True
    same = (layout.engine, layout.sp, layout.tp, layout.pp, layout.cp) == (
        p.actor.engine,
        p.actor.sp,
        p.actor.tp,
        p.actor.pp,
        p.actor.cp,
    )
    return not same


def model_parallel_fix(layout: RoleLayout, gpus: int, arch: Architecture | None) -> KeyFix | None:
    """Tensor parallel sizes that make tp·pp·cp divide the GPUs and that Megatron accepts for the model's heads
    (largest ≤ current first)."""
    rest = product(layout.pp, layout.cp)
    if not rest or gpus % rest:
        return None
    valid = [tp for tp in divisors(gpus // rest) if megatron_tp_ok(arch, tp)]
    if not valid:
        return None
    return KeyFix(layout.keys[0], tuple(largest_first_at_most(layout.tp or 1, valid)), complete=True)


@check("layout-megatron-gpus", "Megatron: tensor × pipeline × context parallel divides the GPU count")
def megatron_gpus(ctx: RuleContext) -> list[Draft]:
    """validate_config (fixed batch size) and Megatron's own initialisation (always)."""
    p = plan(ctx)
    drafts: list[Draft] = []
    for layout in used_roles(p):
        mp = layout.model_parallel
        if layout.engine != "megatron" or not distinct(p, layout) or mp is None or p.gpus is None:
            continue
        if p.gpus % mp:
            msg = (
                f"the {p.gpus} GPUs are not divisible by the {layout.role}'s tensor × pipeline × context parallel "
                f"= {layout.tp} × {layout.pp} × {layout.cp} = {mp}; {verl_release().name} stops before training"
            )
            arch = ctx.critic_arch if layout.role == "critic" else ctx.actor_arch
            path = "critic.model.path" if layout.role == "critic" else f"{ARR}.model.path"
            fix = model_parallel_fix(layout, p.gpus, arch)
            drafts.append(Draft((*layout.keys, GPUS_PER_NODE, NNODES), msg, (fix,), reads=(path,)))
    return drafts


def vpp_group(view: ConfigView, layout: RoleLayout) -> int | None:
    """Megatron's microbatch_group_size_per_vp_stage (default: the pipeline size)."""
    prefix = layout.keys[0].rsplit(".", 1)[0]
    override = pos_int(view.get(f"{prefix}.override_transformer_config.microbatch_group_size_per_vp_stage"))
    return override or layout.pp


@check("layout-megatron-vpp", "Megatron VPP: micro batches per batch divisible by the VPP group size")
def megatron_vpp(ctx: RuleContext) -> list[Draft]:
    """forward_backward_batch: ``micro_batches ... must be divisible by num_batches_divided_by``."""
    view, p = ctx.view, plan(ctx)
    layout = p.actor
    if layout.engine != "megatron" or not layout.vpp or layout.vpp < 2 or p.dynamic:
        return []
    group = vpp_group(view, layout)
    if not group:
        return []
    passes = [
        (ACTOR_MICRO, p.mini_per_gpu, p.micro, "actor update"),
        (LOGPROB_MICRO, p.logprob_rows, p.logprob_micro, "old log-prob"),
    ]
    if p.use_ref and not p.ref_dynamic and p.ref.engine == "megatron":
        passes.append((REF_MICRO, p.ref_rows, p.ref_micro, "reference log-prob"))
    return [d for d in (_vpp_draft(view, group, *args) for args in passes) if d]


def _vpp_draft(
    view: ConfigView, group: int, key: str, rows: int | None, micro: int | None, stage: str
) -> Draft | None:
    count = exact(rows, micro)
    if count is None or rows is None or count % group == 0:
        return None
    msg = (
        f"{kv(view, key)} splits the {rows} sequences per data-parallel rank of the {stage} pass into {count} "
        f"micro batches, not a multiple of the virtual-pipeline group size {group}; {first_step()}"
    )
    valid = [d for d in divisors(rows) if (rows // d) % group == 0]
    fix = KeyFix(key, tuple(largest_first_at_most(micro or 1, valid)), complete=True) if valid else None
    return Draft((key, f"{ARR}.actor.megatron.virtual_pipeline_model_parallel_size"), msg, (fix,))


def sp_key(view: ConfigView, layout: RoleLayout) -> str:
    """The Ulysses key whose value the role uses (the legacy actor/ref key wins when above 1)."""
    first = pos_int(view.get(layout.keys[0]))
    return layout.keys[0] if len(layout.keys) == 1 or (first and first > 1) else layout.keys[-1]


def sp_fix(view: ConfigView, layout: RoleLayout, gpus: int, arch: Architecture | None) -> KeyFix | None:
    """Ulysses sizes that divide the GPUs (and the heads, when the architecture is known)."""
    valid = [s for s in divisors(gpus) if heads_ok(arch, s)]
    key = sp_key(view, layout)
    return KeyFix(key, tuple(largest_first_at_most(layout.sp or 1, valid)), complete=True) if valid else None


def heads_ok(arch: Architecture | None, sp: int) -> bool:
    """verl's Ulysses patch: heads divisible by sp; KV heads divisible by sp or the other way round (an unknown
    model: any size)."""
    if arch is None:
        return True
    kv_heads = arch.num_key_value_heads
    return arch.num_attention_heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def ulysses_roles(p: BatchPlan) -> Iterator[RoleLayout]:
    """The FSDP roles that run with a Ulysses size above 1."""
    for layout in used_roles(p):
        if layout.engine == "fsdp" and layout.sp and layout.sp > 1 and distinct(p, layout):
            yield layout


@check("layout-ulysses-gpus", "Ulysses sequence parallel size divides the GPU count")
def ulysses_gpus(ctx: RuleContext) -> list[Draft]:
    """The FSDP engine's device mesh (torch init_device_mesh) when the workers start."""
    p = plan(ctx)
    drafts: list[Draft] = []
    for layout in ulysses_roles(p):
        if p.gpus is not None and layout.sp and p.gpus % layout.sp:
            msg = f"{layout.role} Ulysses sequence parallel size {layout.sp} does not divide the {p.gpus} GPUs; {init()}"
            drafts.append(
                Draft((*layout.keys, GPUS_PER_NODE, NNODES), msg, (sp_fix(ctx.view, layout, p.gpus, None),))
            )
    return drafts


@check(
    "layout-ulysses-heads",
    "Ulysses size divides the attention heads (KV heads: either way)",
    needs=("code:ulysses-heads",),
)
def ulysses_heads(ctx: RuleContext) -> list[Draft]:
    """verl's Ulysses monkey patch: ``num_attention_heads ... must be divisible by ulysses_sp_size``."""
    p = plan(ctx)
    drafts: list[Draft] = []
    for layout in ulysses_roles(p):
        arch = ctx.critic_arch if layout.role == "critic" else ctx.actor_arch
        path_key = "critic.model.path" if layout.role == "critic" else f"{ARR}.model.path"
        if arch is None:
            why = f"no config.json found for {kv(ctx.view, path_key)}, so the heads cannot be checked"
            drafts.append(skipped((*layout.keys, path_key), why))
        elif layout.sp and not heads_ok(arch, layout.sp):
            drafts.append(_heads_draft(ctx.view, layout, arch, p.gpus, path_key))
    return drafts


def _heads_draft(
    view: ConfigView, layout: RoleLayout, arch: Architecture, gpus: int | None, path_key: str
) -> Draft:
    msg = (
        f"{layout.role} Ulysses sequence parallel size {layout.sp} does not fit {arch.name}: "
        f"{arch.num_attention_heads} attention heads and {arch.num_key_value_heads} KV heads (from {arch.source}) "
        f"must each divide by it (KV heads may instead divide it); {init()}"
    )
    return Draft((*layout.keys, path_key), msg, (sp_fix(view, layout, gpus or 1, arch),))


@check(
    "verl-sp-remove-padding",
    "Ulysses sequence parallelism needs model.use_remove_padding=true",
    needs=("code:sp-remove-padding",),
)
def sp_remove_padding(ctx: RuleContext) -> list[Draft]:
    """FSDPActorConfig.validate (actor) and the FSDP engine (every role)."""
    p = plan(ctx)
    drafts: list[Draft] = []
    for layout in ulysses_roles(p):
        key = (
            "critic.model.use_remove_padding"
            if layout.role == "critic"
            else f"{ARR}.model.use_remove_padding"
        )
        if ctx.view.get(key) is not True:
            msg = f"{layout.role} Ulysses sequence parallel size {layout.sp} needs {key}=true, but it is "
            msg += (
                f"{format_value(ctx.view.get(key))}; {stops('sp-remove-padding')} (or when the workers start)"
            )
            fixes = (set_fix(key, True), set_fix(sp_key(ctx.view, layout), 1))
            drafts.append(Draft((key, *layout.keys), msg, fixes))
    return drafts


RULES: tuple[Rule[RuleContext], ...] = (
    megatron_gpus,
    megatron_vpp,
    ulysses_gpus,
    ulysses_heads,
    sp_remove_padding,
)

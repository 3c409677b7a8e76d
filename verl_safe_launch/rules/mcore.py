"""Megatron's limits on the model: tensor parallel vs heads, pipeline (and virtual pipeline) vs layers, experts.

Checked against megatron-core 0.18.0, the release verl 0.9.1's lock pins (``core_v0.18.0``); before 0.16
megatron-core also refused query groups fewer than the tensor parallel size, so these rules apply from verl 0.9.1
on. ``docs/concepts/engines.md`` lists each check with file and line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.context import Architecture, RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.rules.fixes import KeyFix, divisors, largest_first_at_most
from verl_safe_launch.rules.kit import Draft, check, kv, plan, skipped
from verl_safe_launch.rules.plan import GPUS_PER_NODE, NNODES, BatchPlan, RoleLayout, pos_int

INIT = "verl only finds out when the workers build the models"
NEEDS = ("since:0.9.1",)


@dataclass(frozen=True)
class Megatron:
    """One Megatron role's parallel sizes and the model it trains."""

    layout: RoleLayout
    arch: Architecture
    meg: str
    path_key: str
    gpus: int | None

    @property
    def tp(self) -> int:
        return self.layout.tp or 1

    @property
    def pp(self) -> int:
        return self.layout.pp or 1

    @property
    def cp(self) -> int:
        return self.layout.cp or 1

    def get(self, view: ConfigView, name: str) -> object:
        return view.get(f"{self.meg}.{name}")

    def key(self, name: str) -> str:
        return f"{self.meg}.{name}"


def megatron_roles(
    ctx: RuleContext, what: str, needed: Callable[[RoleLayout], bool]
) -> Iterator[Megatron | Draft]:
    """Each Megatron role that runs (the reference only when it differs from the actor), with its model."""
    p = plan(ctx)
    roles = [p.actor, *([p.ref] if p.use_ref else []), *([p.critic] if p.use_critic else [])]
    for layout in roles:
        if layout.engine != "megatron" or not needed(layout) or not _distinct(p, layout):
            continue
        critic = layout.role == "critic"
        arch = ctx.critic_arch if critic else ctx.actor_arch
        path_key = "critic.model.path" if critic else f"{ARR}.model.path"
        if arch is None:
            why = f"no config.json found for {kv(ctx.view, path_key)}, so {what} cannot be checked"
            yield skipped((*layout.keys, path_key), why)
            continue
        meg = layout.keys[0].rsplit(".", 1)[0]
        yield Megatron(layout, arch, meg, path_key, p.gpus)


def _distinct(p: BatchPlan, layout: RoleLayout) -> bool:
    """False for a reference laid out as the actor is (its findings would repeat the actor's)."""
    if layout.role != "ref":
        return True
    same = (layout.tp, layout.pp, layout.cp, layout.vpp) == (p.actor.tp, p.actor.pp, p.actor.cp, p.actor.vpp)
    return not same or p.actor.engine != "megatron"


def heads_refusal(arch: Architecture, tp: int) -> str | None:
    """TransformerConfig.__post_init__'s message for ``tp`` on this model, or None."""
    if arch.num_attention_heads % tp:
        return (
            f"num_attention_heads ({arch.num_attention_heads}) must be a multiple of "
            f"tensor_model_parallel_size ({tp})."
        )
    groups = arch.num_key_value_heads or arch.num_attention_heads
    if not arch.mla and groups % tp and tp % groups:
        return (
            f"num_query_groups ({groups}) must be a multiple or divisor of tensor_model_parallel_size ({tp})."
        )
    return None


def _fix(key: str, current: int, valid: list[int]) -> tuple[KeyFix | None, ...]:
    return (KeyFix(key, tuple(largest_first_at_most(current, valid)), complete=True) if valid else None,)


def _gpu_choices(gpus: int | None, rest: int, ok: Callable[[int], bool], limit: int) -> list[int]:
    """Sizes ``ok`` accepts that, times ``rest``, divide the GPUs (when known)."""
    pool = [d // rest for d in divisors(gpus) if d % rest == 0] if gpus else list(range(1, limit + 1))
    return [size for size in pool if ok(size)]


@check(
    "megatron-tp-heads",
    "Megatron: tensor parallel divides the attention heads; query groups divide it or it divides them",
    needs=NEEDS,
)
def megatron_tp_heads(ctx: RuleContext) -> list[Draft]:
    """megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__."""
    found = megatron_roles(ctx, "the attention heads", lambda layout: (layout.tp or 1) > 1)
    return [d for role in found if (d := role if isinstance(role, Draft) else _tp_draft(ctx.view, role))]


def _tp_draft(view: ConfigView, role: Megatron) -> Draft | None:
    said = heads_refusal(role.arch, role.tp)
    if said is None:
        return None
    arch, tp_key = role.arch, role.layout.keys[0]
    msg = (
        f"{kv(view, tp_key)} does not fit {arch.name} ({arch.num_attention_heads} attention "
        f"heads, {arch.num_key_value_heads} KV heads, from {arch.source}): Megatron's TransformerConfig stops "
        f'with "{said}"; {INIT}'
    )
    valid = _gpu_choices(role.gpus, role.pp * role.cp, lambda t: heads_refusal(arch, t) is None, 256)
    reads = (*role.layout.keys, GPUS_PER_NODE, NNODES)
    return Draft((tp_key, role.path_key), msg, _fix(tp_key, role.tp, valid), reads=reads)


@dataclass(frozen=True)
class Stages:
    """How the pipeline split is asked for: even, or with set first/last stages, embedding and loss counted."""

    first: int | None
    last: int | None
    embedding: bool
    loss: bool


def stages(view: ConfigView, role: Megatron) -> Stages:
    """The pipeline-split settings a role passes to Megatron through override_transformer_config."""
    over = "override_transformer_config"
    first = pos_int(role.get(view, f"{over}.num_layers_in_first_pipeline_stage"))
    last = pos_int(role.get(view, f"{over}.num_layers_in_last_pipeline_stage"))
    embedding = role.get(view, f"{over}.account_for_embedding_in_pipeline_split") is True
    loss = role.get(view, f"{over}.account_for_loss_in_pipeline_split") is True
    return Stages(first, last, embedding, loss)


def pipeline_refusal(layers: int, pp: int, vpp: int | None, split: Stages) -> str | None:
    """Megatron's first refusal of this pipeline split (TransformerConfig, then the model build), or None."""
    if vpp is not None and pp <= 1:
        return "pipeline-model-parallel size should be greater than 1 with interleaved schedule"
    if split.first is not None or split.last is not None:
        return _uneven_refusal(layers, pp, vpp, split)
    total = layers + int(split.embedding) + int(split.loss)
    if total % pp:
        if split.embedding or split.loss:
            return f"number of middle layers: {total} must be divisible by middle pipeline_model_parallel_size {pp}"
        return f"num_layers={total} should be divisible by config.pipeline_model_parallel_size={pp}"
    per_rank = total // pp
    if vpp is not None and per_rank % vpp:
        return f"num_layers_per_pipeline_rank {per_rank} should be divisible by vp_size {vpp}"
    return None


def _uneven_refusal(layers: int, pp: int, vpp: int | None, split: Stages) -> str | None:
    middle_layers, middle_stages = layers, pp
    for name, count in (("first", split.first), ("last", split.last)):
        if count is None:
            continue
        if vpp is not None and count % vpp:
            return (
                f"number of layers at {name} stage: {count}must be divisible by virtual pipelineparallel "
                f"degree {vpp}"
            )
        middle_layers -= count
        middle_stages -= 1
    if bool(middle_layers) != bool(middle_stages):
        return f"Mismatch: {middle_layers} middle layers remaining but {middle_stages} middle PP stages available."
    if middle_stages and middle_layers % middle_stages:
        return (
            f"number of layers at middle stage: {middle_layers} must be divisible bythe middle pipeline model "
            f"parallel size {middle_stages}"
        )
    if middle_stages and vpp is not None and (middle_layers // middle_stages) % vpp:
        return (
            f"number of layers on each middle pipeline rank:{middle_layers // middle_stages} must be divisible by "
            f"virtualpipeline parallel degree {vpp}"
        )
    return None


@check(
    "megatron-pp-layers",
    "Megatron: pipeline (and virtual pipeline) parallel split the decoder layers evenly",
    needs=NEEDS,
)
def megatron_pp_layers(ctx: RuleContext) -> list[Draft]:
    """parallel_state.initialize_model_parallel, TransformerConfig.__post_init__, get_num_layers_to_build."""

    def wanted(layout: RoleLayout) -> bool:
        return (layout.pp or 1) > 1 or layout.vpp is not None

    found = megatron_roles(ctx, "the layers", wanted)
    return [d for role in found if (d := role if isinstance(role, Draft) else _pp_draft(ctx.view, role))]


def _pp_draft(view: ConfigView, role: Megatron) -> Draft | None:
    split, vpp, layers = stages(view, role), role.layout.vpp, role.arch.num_hidden_layers
    said = pipeline_refusal(layers, role.pp, vpp, split)
    if said is None:
        return None
    pp_key, vpp_key = role.layout.keys[1], role.key("virtual_pipeline_model_parallel_size")
    sizes = (
        f"{kv(view, pp_key)} and {kv(view, vpp_key)} do" if vpp is not None else f"{kv(view, pp_key)} does"
    )
    msg = (
        f"{sizes} not split {role.arch.name}'s {layers} layers (from {role.arch.source}): Megatron stops with "
        f'"{said}"; {INIT}'
    )
    valid = _gpu_choices(
        role.gpus, role.tp * role.cp, lambda pp: pipeline_refusal(layers, pp, vpp, split) is None, layers
    )
    fixes = _fix(pp_key, role.pp, valid)
    if vpp is not None:
        fixes += (_vpp_fix(vpp_key, vpp, layers, role.pp, split),)
    keys = (pp_key, *((vpp_key,) if vpp is not None else ()), role.path_key)
    reads = (*role.layout.keys, GPUS_PER_NODE, NNODES, role.key("override_transformer_config"))
    return Draft(keys, msg, fixes, reads=reads)


def _vpp_fix(key: str, vpp: int, layers: int, pp: int, split: Stages) -> KeyFix:
    """Virtual pipeline sizes above 1 that split this pipeline's layers evenly, else none (null)."""
    valid = [v for v in range(2, layers + 1) if pipeline_refusal(layers, pp, v, split) is None]
    if not valid:
        return KeyFix(key, (None,))
    return KeyFix(key, tuple(largest_first_at_most(vpp, valid)), complete=True)


def expert_refusal(arch: Architecture, ep: int, world: tuple[int | None, int]) -> str | None:
    """Megatron's refusal of ``ep`` for this model: no experts, experts uneven, or the GPUs uneven."""
    gpus, per_ep = world
    if not arch.num_experts:
        return '"num_moe_experts must be non None to use expert-parallel." (TransformerConfig)'
    if arch.num_experts % ep:
        return "a bare AssertionError in MoELayer (assert self.config.num_moe_experts % ep_size == 0)"
    if gpus is not None and gpus % (per_ep * ep):
        size = per_ep * ep
        return (
            f'"world_size ({gpus}) is not divisible by expert_tensor_model_pipeline_parallel size ({size})" '
            "(initialize_model_parallel)"
        )
    return None


@check(
    "megatron-ep-experts",
    "Megatron: expert parallel needs experts, divides them, and expert tp × ep × pp divides the GPUs",
    needs=NEEDS,
)
def megatron_ep_experts(ctx: RuleContext) -> list[Draft]:
    """TransformerConfig.__post_init__, MoELayer.__init__, parallel_state.initialize_model_parallel."""
    found = megatron_roles(ctx, "the experts", lambda layout: _ep(ctx.view, layout) > 1)
    return [d for role in found if (d := role if isinstance(role, Draft) else _ep_draft(ctx.view, role))]


def _ep(view: ConfigView, layout: RoleLayout) -> int:
    return pos_int(view.get(layout.keys[0].rsplit(".", 1)[0] + ".expert_model_parallel_size")) or 1


def _ep_draft(view: ConfigView, role: Megatron) -> Draft | None:
    ep_key, etp_key = role.key("expert_model_parallel_size"), role.key("expert_tensor_parallel_size")
    ep, arch, gpus = _ep(view, role.layout), role.arch, role.gpus
    per_ep = (pos_int(view.get(etp_key)) or role.tp) * role.pp
    said = expert_refusal(arch, ep, (gpus, per_ep))
    if said is None:
        return None
    experts = f"{arch.num_experts} experts" if arch.num_experts else "no experts"
    msg = (
        f"{kv(view, ep_key)} does not fit {arch.name} ({experts}, from {arch.source}) on {gpus} GPUs: "
        f"Megatron stops with {said}; {INIT}"
    )
    valid = _gpu_choices(
        gpus, per_ep, lambda e: e == 1 or expert_refusal(arch, e, (gpus, per_ep)) is None, 256
    )
    reads = (etp_key, role.layout.keys[0], role.layout.keys[1], GPUS_PER_NODE, NNODES)
    return Draft((ep_key, role.path_key), msg, _fix(ep_key, ep, valid), reads=reads)


def megatron_tp_ok(arch: Architecture | None, tp: int) -> bool:
    """Whether Megatron's TransformerConfig accepts tensor parallel ``tp`` for this model."""
    return arch is None or heads_refusal(arch, tp) is None


RULES: tuple[Rule[RuleContext], ...] = (megatron_tp_heads, megatron_pp_layers, megatron_ep_experts)

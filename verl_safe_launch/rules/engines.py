"""Rollout engine limits: what vLLM and SGLang (as verl 0.9 pins and starts them) refuse about the model.

Each rule applies to the engine ``rollout.name`` names and quotes that engine's own refusal. The sources
(vLLM 0.24.0 and SGLang 0.5.12, the versions verl 0.9.1 pins) are cited per rule; ``docs/concepts/engines.md``
lists them with file and line.
"""

from __future__ import annotations

from collections.abc import Callable

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.context import Architecture, RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.rules.fixes import KeyFix, divisors, largest_first_at_most, set_fix
from verl_safe_launch.rules.kit import Draft, check, kv, plan, skipped
from verl_safe_launch.rules.plan import (
    GPUS_PER_NODE,
    NNODES,
    ROLLOUT_DP,
    ROLLOUT_PP,
    ROLLOUT_TP,
    BatchPlan,
    pos_int,
    product,
)

R = f"{ARR}.rollout"
NAME = f"{R}.name"
MODEL = f"{ARR}.model.path"
ROLLOUT_EP = f"{R}.expert_parallel_size"
MAX_LEN = f"{R}.max_model_len"
VLLM_MAX_LEN = f"{R}.engine_kwargs.vllm.max_model_len"
DP_ATTENTION = f"{R}.engine_kwargs.sglang.enable_dp_attention"
STARTS = "verl only finds out when it starts the rollout replicas"
LAYOUT_READS = (GPUS_PER_NODE, NNODES, ROLLOUT_DP, ROLLOUT_PP)


def split_refusal(heads: int, kv_heads: int, tp: int, mla: bool) -> str | None:
    """Why ``tp`` GPUs cannot split the attention (None: they can); vLLM and SGLang split heads alike.

    Query heads divide evenly; KV heads divide evenly, or, when fewer than ``tp``, are each replicated on
    ``tp / kv_heads`` GPUs. Multi-head latent attention has one latent, not KV heads to split.
    """
    if heads % tp:
        return "heads"
    if mla or kv_heads <= 0:
        return None
    if tp >= kv_heads:
        return None if tp % kv_heads == 0 else "kv-replicas"
    return None if kv_heads % tp == 0 else "kv-split"


def attention_tp(view: ConfigView, tp: int, dp: int) -> int:
    """The tensor parallel size the engine splits the attention over (SGLang is given tp × dp by verl)."""
    if view.get(NAME) != "sglang" or view.get(DP_ATTENTION) is True:
        return tp
    return tp * dp


def rollout_tp_ok(view: ConfigView, arch: Architecture | None, tp: int) -> bool:
    """Whether the engine ``rollout.name`` names accepts rollout tensor parallel ``tp`` for this model.

    Fixes and presets hold every engine to the split vLLM and SGLang require (only their rules report it).
    """
    if arch is None:
        return True
    dp = pos_int(view.get(ROLLOUT_DP)) or 1
    split = attention_tp(view, tp, dp)
    return split_refusal(arch.num_attention_heads, arch.num_key_value_heads, split, arch.mla) is None


def tp_choices(p: BatchPlan, ok: Callable[[int], bool]) -> list[int]:
    """Rollout TP sizes ``ok`` accepts whose replica (tp·dp·pp) divides the rollout pool, when it is known."""
    rest = product(p.rollout_dp, p.rollout_pp) or 1
    pool = p.rollout_gpus or p.gpus
    candidates = [d // rest for d in divisors(pool) if d % rest == 0] if pool else list(range(1, 257))
    return [tp for tp in candidates if ok(tp)]


def heads_text(arch: Architecture) -> str:
    """``Qwen/Qwen2.5-7B-Instruct's 28 attention heads and 4 KV heads (from ...)``."""
    kv_part = "multi-head latent attention" if arch.mla else f"{arch.num_key_value_heads} KV heads"
    return f"{arch.name}'s {arch.num_attention_heads} attention heads and {kv_part} (from {arch.source})"


def _arch_or_skip(ctx: RuleContext, keys: tuple[str, ...], what: str) -> Architecture | Draft:
    if ctx.actor_arch is not None:
        return ctx.actor_arch
    return skipped(
        (*keys, MODEL), f"no config.json found for {kv(ctx.view, MODEL)}, so {what} cannot be checked"
    )


VLLM_HEADS = (
    'vLLM stops with "Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp})." '
    "(ModelConfig.verify_with_parallel_config)"
)
VLLM_KV = (
    'vLLM\'s QKVParallelLinear stops with "{a} is not divisible by {b}" while loading the model (it splits KV heads '
    "evenly, or replicates them when there are fewer than the tensor parallel size, on a whole number of GPUs each)"
)


@check("vllm-tp-heads", "vLLM: rollout tensor parallel splits the attention heads and the KV heads")
def vllm_tp_heads(ctx: RuleContext) -> list[Draft]:
    """vllm/config/model.py verify_with_parallel_config; vllm/model_executor/layers/linear.py QKVParallelLinear."""
    view, tp = ctx.view, pos_int(ctx.view.get(ROLLOUT_TP))
    if view.get(NAME) != "vllm" or tp is None or tp == 1:
        return []
    arch = _arch_or_skip(ctx, (ROLLOUT_TP,), "the attention heads")
    if isinstance(arch, Draft):
        return [arch]
    refusal = split_refusal(arch.num_attention_heads, arch.num_key_value_heads, tp, arch.mla)
    if refusal is None:
        return []
    kv_heads = arch.num_key_value_heads
    if refusal == "heads":
        said = VLLM_HEADS.format(heads=arch.num_attention_heads, tp=tp)
    else:
        said = VLLM_KV.format(
            a=tp if refusal == "kv-replicas" else kv_heads, b=kv_heads if refusal == "kv-replicas" else tp
        )
    msg = f"{kv(view, ROLLOUT_TP)} does not split {heads_text(arch)}: {said}; {STARTS}"
    return [_tp_draft(ctx, msg)]


SGLANG_ASSERT = {
    "heads": "assert self.total_num_heads % tp_size == 0",
    "kv-split": "assert self.total_num_kv_heads % tp_size == 0",
    "kv-replicas": "assert tp_size % self.total_num_kv_heads == 0",
}


@check(
    "sglang-tp-heads",
    "SGLang: the tensor parallel size verl gives it (rollout tp × dp) splits the attention and KV heads",
    needs=("since:0.7.1",),
)
def sglang_tp_heads(ctx: RuleContext) -> list[Draft]:
    """SGLang's model attention (e.g. srt/models/qwen2.py Qwen2Attention) asserts the split, without a message."""
    view, tp = ctx.view, pos_int(ctx.view.get(ROLLOUT_TP))
    dp = pos_int(view.get(ROLLOUT_DP)) or 1
    if view.get(NAME) != "sglang" or tp is None:
        return []
    split = attention_tp(view, tp, dp)
    if split == 1:
        return []
    arch = _arch_or_skip(ctx, (ROLLOUT_TP, ROLLOUT_DP), "the attention heads")
    if isinstance(arch, Draft):
        return [arch]
    refusal = split_refusal(arch.num_attention_heads, arch.num_key_value_heads, split, arch.mla)
    if refusal is None:
        return []
    given = kv(view, ROLLOUT_TP) if split == tp else f"rollout tensor × data parallel = {tp} × {dp} = {split}"
    how = "(verl starts SGLang with tp_size = tensor × data parallel) " if split != tp else ""
    msg = (
        f"{given} {how}does not split {heads_text(arch)}: SGLang's attention stops with a bare AssertionError "
        f"({SGLANG_ASSERT[refusal]}, tp_size={split}); {STARTS}"
    )
    return [_tp_draft(ctx, msg, (ROLLOUT_TP, ROLLOUT_DP))]


def _tp_draft(ctx: RuleContext, msg: str, keys: tuple[str, ...] = (ROLLOUT_TP,)) -> Draft:
    p = plan(ctx)
    valid = tp_choices(p, lambda tp: rollout_tp_ok(ctx.view, ctx.actor_arch, tp))
    current = pos_int(ctx.view.get(ROLLOUT_TP)) or 1
    fix = KeyFix(ROLLOUT_TP, tuple(largest_first_at_most(current, valid)), complete=True) if valid else None
    return Draft((*keys, MODEL), msg, (fix,), reads=(*LAYOUT_READS, NAME))


def vllm_derived_len(arch: Architecture) -> tuple[float, str] | None:
    """vLLM's own maximum length for the model (None: config.json states none), and the key it came from.

    The smallest length key (``model_max_length`` wins when present), then the RoPE scaling factor of every
    type but su/longrope/llama3 (yarn: from ``original_max_position_embeddings``); Gemma 3 is not rescaled.
    """
    if not arch.length_keys:
        return None
    key, derived = min(arch.length_keys, key=lambda item: item[1])
    found = dict(arch.length_keys)
    if "model_max_length" in found:
        key, derived = "model_max_length", found["model_max_length"]
    if not arch.rope_scaling or "gemma3" in arch.model_type:
        return float(derived), key
    factor: float | None = 1.0
    value = float(derived)
    for rope in arch.rope_scaling:
        if rope.rope_type in ("su", "longrope", "llama3"):
            continue
        factor = rope.factor if rope.factor is not None else factor
        if rope.rope_type == "yarn":
            value = float(rope.original_max_position_embeddings or arch.max_position_embeddings)
    return value * (factor or 1.0), key


def _whole(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


@check(
    "vllm-max-model-len",
    "vLLM: the max_model_len verl starts it with is within vLLM's own limit for the model (RoPE scaling included)",
    needs=("since:0.7.1",),
)
def vllm_max_model_len(ctx: RuleContext) -> list[Draft]:
    """vllm/config/model.py _get_and_verify_max_len on the value verl passes (its own, or max_position_embeddings)."""
    view, arch = ctx.view, ctx.actor_arch
    if view.get(NAME) != "vllm" or arch is None:
        return []
    own, extra = pos_int(view.get(MAX_LEN)), pos_int(view.get(VLLM_MAX_LEN))
    positions = arch.max_position_embeddings
    if extra is None and own is not None and positions and own > positions:
        return []  # verl's own check stops first (layout-rollout-max-model-len)
    value = extra or own or positions
    derived = vllm_derived_len(arch)
    if not value or derived is None or value <= derived[0]:
        return []
    limit, key = derived
    model_max = dict(arch.length_keys).get("model_max_length")
    if model_max is not None and value <= model_max:
        return []
    given = (
        kv(view, VLLM_MAX_LEN)
        if extra
        else (
            kv(view, MAX_LEN)
            if own
            else f"{kv(view, MAX_LEN)} (verl then passes max_position_embeddings {positions})"
        )
    )
    said = (
        f"User-specified max_model_len ({value}) is greater than the derived max_model_len ({key}={_whole(limit)} "
        f"or model_max_length={model_max} in model's config.json)."
    )
    msg = (
        f"{given}: vLLM derives at most {_whole(limit)} tokens for {arch.name} (from {arch.source}) and stops with "
        f'"{said}" unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set; {STARTS}'
    )
    target = VLLM_MAX_LEN if extra else MAX_LEN
    return [Draft((target, MODEL), msg, (set_fix(target, int(limit)),), reads=(MAX_LEN, VLLM_MAX_LEN))]


@check(
    "vllm-expert-parallel",
    "vLLM: rollout expert parallel needs a mixture-of-experts model",
    needs=("since:0.7.1",),
)
def vllm_expert_parallel(ctx: RuleContext) -> list[Draft]:
    """verl turns on enable_expert_parallel when expert_parallel_size > 1; vLLM's _verify_with_expert_parallelism."""
    view, ep, arch = ctx.view, pos_int(ctx.view.get(ROLLOUT_EP)), ctx.actor_arch
    if view.get(NAME) != "vllm" or ep is None or ep == 1 or arch is None or arch.num_experts:
        return []
    msg = (
        f"{kv(view, ROLLOUT_EP)} turns on vLLM's expert parallelism, but {arch.name} has no experts (from "
        f'{arch.source}): vLLM stops with "Number of experts in the model must be greater than 0 when expert '
        f'parallelism is enabled."; {STARTS}'
    )
    return [Draft((ROLLOUT_EP, MODEL), msg, (set_fix(ROLLOUT_EP, 1),))]


@check(
    "sglang-moe-split",
    "SGLang: rollout expert parallel divides the experts; the expert tensor parallel split divides their width",
    needs=("since:0.7.1",),
)
def sglang_moe_split(ctx: RuleContext) -> list[Draft]:
    """srt/layers/moe/fused_moe_triton/layer.py FusedMoE: experts % ep and intermediate % moe_tp (bare asserts)."""
    view, arch = ctx.view, ctx.actor_arch
    tp, dp = pos_int(view.get(ROLLOUT_TP)), pos_int(view.get(ROLLOUT_DP)) or 1
    ep = pos_int(view.get(ROLLOUT_EP)) or 1
    if view.get(NAME) != "sglang" or arch is None or not arch.num_experts or tp is None or (tp * dp) % ep:
        return []
    keys = (ROLLOUT_EP, ROLLOUT_TP, ROLLOUT_DP, MODEL)
    if arch.num_experts % ep:
        msg = (
            f"{kv(view, ROLLOUT_EP)} does not divide {arch.name}'s {arch.num_experts} experts (from {arch.source}): "
            f"SGLang's FusedMoE stops with a bare AssertionError (assert (num_experts - num_shared_slots) % "
            f"self.moe_ep_size == 0); {STARTS}"
        )
        valid = tuple(e for e in sorted({1, tp * dp}) if _moe_refusal(arch, tp * dp, e) is None)
        return [Draft(keys, msg, (KeyFix(ROLLOUT_EP, valid),) if valid else ())]
    moe_tp, width = tp * dp // ep, arch.expert_intermediate_size
    if width % moe_tp == 0:
        return []
    msg = (
        f"the experts of {arch.name} are {width} wide (from {arch.source}), which SGLang's expert tensor parallel "
        f"size tp × dp / ep = {tp} × {dp} / {ep} = {moe_tp} does not divide: its FusedMoE stops with a bare "
        f"AssertionError (assert intermediate_size % self.moe_tp_size == 0); {STARTS}"
    )
    fixes: list[KeyFix | None] = []
    if arch.num_experts % (tp * dp) == 0:
        fixes.append(set_fix(ROLLOUT_EP, tp * dp))
    return [Draft(keys, msg, tuple(fixes))]


def _moe_refusal(arch: Architecture, tp_size: int, ep: int) -> str | None:
    """Which of FusedMoE's splits fails for SGLang's tp_size and expert parallel ``ep`` (None: neither)."""
    if arch.num_experts % ep:
        return "experts"
    return "width" if arch.expert_intermediate_size % (tp_size // ep) else None


@check(
    "sglang-dp-nodes",
    "SGLang: rollout data parallel across nodes needs DP attention",
    needs=("since:0.7.1",),
)
def sglang_dp_nodes(ctx: RuleContext) -> list[Draft]:
    """srt/server_args.py check_server_args: ``multi-node data parallel is not supported unless dp attention!``."""
    view, p = ctx.view, plan(ctx)
    gpn = pos_int(view.get(GPUS_PER_NODE))
    dp, world = p.rollout_dp, p.rollout_world
    if view.get(NAME) != "sglang" or not dp or dp < 2 or not gpn or not world or world <= gpn:
        return []
    if view.get(DP_ATTENTION) is True:
        return []
    msg = (
        f"{kv(view, ROLLOUT_DP)} makes a replica of {world} GPUs, more than a node's {gpn}: SGLang stops with "
        f'"multi-node data parallel is not supported unless dp attention!" (DP attention is SGLang\'s '
        f"enable_dp_attention, set through {R}.engine_kwargs.sglang); {STARTS}"
    )
    per_dp = product(p.rollout_tp, p.rollout_pp) or 1
    fits = [d for d in range(dp - 1, 0, -1) if d * per_dp <= gpn]
    fix = KeyFix(ROLLOUT_DP, tuple(fits)) if fits else None
    return [
        Draft((ROLLOUT_DP, ROLLOUT_TP, GPUS_PER_NODE), msg, (fix,), reads=(ROLLOUT_PP, DP_ATTENTION, NAME))
    ]


RULES: tuple[Rule[RuleContext], ...] = (
    vllm_tp_heads,
    sglang_tp_heads,
    vllm_max_model_len,
    vllm_expert_parallel,
    sglang_moe_split,
    sglang_dp_nodes,
)

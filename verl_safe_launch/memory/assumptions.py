"""The assumption lines of an estimate that depend on the engine or the architecture, and which log-prob kernel
verl runs (flash-attn's cross-entropy or its row-wise fallback)."""

from __future__ import annotations

from verl_safe_launch.config_view import ARR
from verl_safe_launch.context import Architecture, RuleContext
from verl_safe_launch.memory.engine import Engine
from verl_safe_launch.memory.terms import kv_bytes_per_token, vision_params


def architecture_lines(arch: Architecture) -> list[str]:
    """What of the architecture is counted beyond a plain decoder: latent attention, a vision tower."""
    lines = []
    if arch.mla:
        width = arch.kv_lora_rank + arch.qk_rope_head_dim
        lines.append(
            f"multi-head latent attention: parameters and activations of the latent projections (kv_lora_rank "
            f"{arch.kv_lora_rank}, q_lora_rank {arch.q_lora_rank or 'none'}); the rollout caches the latent, "
            f"{width} values per token per layer ({kv_bytes_per_token(arch, 1):,} B per token in bf16)"
        )
    if arch.vision:
        v = arch.vision
        lines.append(
            f"vision tower: {vision_params(arch) / 1e9:.2f}B parameters ({v.depth} blocks, width {v.hidden_size}) "
            f"counted with the model's {arch.params / 1e9:.2f}B; activations for images filling every prompt "
            f"({v.merge} patches per image token; blocks modelled as Llama layers at that width, not traced)"
        )
    return lines


def dtype_name(e: Engine) -> str:
    """The engine's parameter dtype, as the assumptions say it."""
    return "fp32" if e.dtype_bytes == 4 else "bf16"


def offload_text(e: Engine) -> str:
    """What of the engine waits on the CPU outside its stage (empty when nothing)."""
    flags = [n for n, on in (("params", e.param_offload), ("optimizer", e.optimizer_offload)) if on]
    if e.cpu_policy:
        return "; FSDP2 CPU offload policy: shards live on the CPU"
    return f"; offloaded to the CPU outside their stage: {', '.join(flags)}" if flags else ""


def entropy_line(e: Engine) -> str:
    """How the engine computes the entropy over the logits."""
    if e.fused_kernels:
        return "fused kernels: log-probs and entropy in 512-token chunks, no full-vocabulary logits"
    if e.entropy_chunking:
        return f"entropy in chunks of {e.entropy_chunk} tokens (fp32 per chunk)"
    if e.compile_entropy:
        return "entropy compiled (torch.compile): fused reductions, no full-vocabulary fp32 buffer"
    return "entropy eager: fp32 softmax and product over the full vocabulary"


FLASH_CE_ENV_KEY = "ray_kwargs.ray_init.runtime_env.env_vars.VERL_DISABLE_FLASH_ATTN_CE"


def flash_decides(ctx: RuleContext) -> bool:
    """Whether flash-attn being installed decides verl's log-prob path (not fused kernels, not switched off)."""
    fused = ctx.view.get(f"{ARR}.model.use_fused_kernels") is True
    return not fused and str(ctx.view.get(FLASH_CE_ENV_KEY)) != "1"


def logits_path(ctx: RuleContext) -> tuple[bool, str]:
    """Whether verl computes log-probs with flash-attn's cross-entropy, and the assumption line saying why."""
    fallback = "verl's logprobs_from_logits_v2 (row-wise log_softmax, a saved copy and a separate gradient)"
    if ctx.view.get(f"{ARR}.model.use_fused_kernels") is True:
        return (
            True,
            "log-probs: fused kernels (use_fused_kernels): flash-attn's cross-entropy is not involved",
        )
    if str(ctx.view.get(FLASH_CE_ENV_KEY)) == "1":
        return False, f"log-probs: {fallback}: VERL_DISABLE_FLASH_ATTN_CE=1 in the workers' runtime env"
    flash = ctx.hardware.flash_attn
    if flash is None:
        return False, (
            f"log-probs: {fallback}: flash-attn's cross-entropy not assumed, since nothing here tells whether the "
            "GPU nodes have flash-attn (declare hardware.flash_attn=true if they do)"
        )
    if flash:
        return True, "log-probs: flash-attn cross-entropy (in-place gradient; hardware.flash_attn=true)"
    return False, f"log-probs: {fallback}: flash-attn cross-entropy not used (hardware.flash_attn=false)"

"""Byte formulas of the memory model: activations, logits and temporaries per token, shards, KV cache."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from verl_safe_launch.context import Architecture, PassTerms, TracedTerms

GIB = float(1 << 30)
BF16 = 2
FP32 = 4
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
FUSED_CHUNK_TOKENS = 512  # verl FusedLinearForPPO chunk (verl/utils/experimental/torch_functional.py)


@dataclass(frozen=True)
class LayerCoeffs:
    """Bytes per token saved for backward by one decoder layer (bf16, flash attention, no dropout).

    Saved = h·hidden + q·(heads×head_dim) + kv·(kv_heads×head_dim) + f·intermediate + heads·a + kv_heads·k + const.
    Measured with ``bench/calibrate_memory.py --census`` (saved-tensor census of the transformers modules).
    """

    hidden: int
    q: int
    kv: int
    mlp: int
    heads: int
    kv_heads: int
    const: int
    q_norm: bool = False
    fused_gate_up: bool = False
    router_fp32: int = 0  # bytes × hidden an MoE layer's fp32 router saves (DeepSeek routes in fp32)
    moe_backward: int = 4  # bytes × hidden per routed copy in an MoE layer's backward


# Llama and Qwen2 layers save the same tensors (Qwen2's q/k/v biases save nothing); Qwen3 adds q/k RMSNorm.
LLAMA = LayerCoeffs(hidden=16, q=4, kv=4, mlp=8, heads=4, kv_heads=0, const=8)
QWEN3 = LayerCoeffs(hidden=16, q=10, kv=10, mlp=8, heads=8, kv_heads=4, const=8, q_norm=True)
# Gemma-2 wraps attention and MLP in two more RMSNorms (post-attention, post-feedforward), each keeping fp32
# copies: +20 bytes × hidden per token (traced on gemma-2-2b without checkpointing, bench/calibrate_memory.py).
GEMMA2 = LayerCoeffs(hidden=36, q=4, kv=4, mlp=8, heads=4, kv_heads=0, const=8)
# Phi-3 fuses q/k/v and gate/up into one projection each: the fused qkv output stays alive behind the value view
# (+2 bytes × q and kv width) and the two zero-probability dropouts still keep a one-byte mask each (+2 × hidden)
# (saved-tensor census of Phi-3-mini, bench/calibrate_memory.py).
PHI3 = LayerCoeffs(hidden=18, q=6, kv=6, mlp=8, heads=4, kv_heads=0, const=8, fused_gate_up=True)
# DeepSeek-V2's MoE layer routes in fp32: the router keeps an fp32 copy of its input (+6 bytes × hidden saved with
# the routing weights), and the routed copies are weighted in fp32, which doubles their gradients in backward
# (traced on DeepSeek-V2-Lite).
DEEPSEEK_V2 = LayerCoeffs(
    hidden=16, q=4, kv=4, mlp=8, heads=4, kv_heads=0, const=8, router_fp32=6, moe_backward=8
)
FAMILIES: dict[str, LayerCoeffs] = {
    "llama": LLAMA,
    "qwen2": LLAMA,
    "mistral": LLAMA,
    "qwen3": QWEN3,
    "gemma2": GEMMA2,
    "mixtral": LLAMA,
    "qwen3_moe": QWEN3,
    "phi3": PHI3,
    "qwen2_moe": LLAMA,
    "deepseek_v2": DEEPSEEK_V2,
    "qwen2_5_vl_text": LLAMA,
    "qwen2_5_vl": LLAMA,
}
# Mixture-of-experts layers (traced on Mixtral-8x7B and a Qwen3-MoE-shaped config, bench/calibrate_memory.py): the MLP terms take the
# routed top-k plus shared width; each token's k routed copies of the hidden state add 4·k·h bytes saved for
# backward and as much again in backward; the forward peaks on the experts' gate/up outputs, 8 bytes per unit of
# active width, beside the routed copies.
MOE_SAVED = 4
MOE_FORWARD = 8


class Entropy(StrEnum):
    """How the per-token entropy over the vocabulary is computed (or not) in a pass."""

    NONE = "none"
    COMPILED = "compiled"
    EAGER = "eager"
    CHUNKED = "chunked"


# Bytes per token per vocabulary entry of the logits and their temporaries at the pass's peak, after the bf16
# logits themselves (sampled after every op: in backward an fp32 gradient and the op's output are alive together) (measured by bench/calibrate_memory.py --variants; COMPILED with a gradient is derived:
# the compiled entropy keeps no full-vocabulary buffer, its backward writes one bf16 gradient).
LOGIT_EXTRA: dict[tuple[Entropy, bool], float] = {
    (Entropy.NONE, False): 0.0,
    (Entropy.NONE, True): 0.0,
    (Entropy.COMPILED, False): 0.0,
    (Entropy.COMPILED, True): 4.0,
    (Entropy.EAGER, False): 8.0,
    (Entropy.EAGER, True): 16.0,
    (Entropy.CHUNKED, False): 0.0,
    (Entropy.CHUNKED, True): 8.0,
}
ENTROPY_CHECKPOINTED_GRAD = 16.0  # recomputed in backward: the same peak as eager, only later
CHUNK_BYTES_PER_ENTRY = {False: 12.0, True: 20.0}  # one chunk's fp32 copy, softmax, product (and gradients)
FUSED_BYTES_PER_ENTRY = {False: 12.0, True: 28.0}  # fused kernels: one 512-token chunk's fp32 temporaries
PER_TOKEN_LOGPROB = 8  # fp32 log-prob and log-sum-exp per token
# Without flash-attn's cross-entropy verl runs logprobs_from_logits_v2: a log_softmax per row of the logits (a row
# is one token with remove padding, one sequence without). Traced (bench/calibrate_memory.py --variants): the
# forward keeps two rows' outputs beside the logits (the last one and the one being computed); with a backward
# every row's output is saved, one more bf16 copy of the whole logits, and the gradient is not written in place.
NO_FLASH_ROWS_LIVE = 2
NO_FLASH_GRAD_BYTES = 2.0
# Final-logit softcapping (Gemma-2/3: tanh(logits / cap) × cap) makes one more bf16 full-vocabulary copy in the
# forward, and the update also keeps tanh's output for backward (traced on gemma-2-2b).
SOFTCAP_BYTES = {False: 2.0, True: 4.0}


@dataclass(frozen=True)
class Pass:
    """One micro batch of one stage on one GPU: tokens, forward only or forward+backward, and the settings."""

    tokens: int
    backward: bool
    vocab: int
    checkpointing: bool = True
    entropy: Entropy = Entropy.NONE
    entropy_chunk: int = 2048
    entropy_checkpointing: bool = False
    temperature_copy: bool = False
    packed_copy: bool = False
    fused_kernels: bool = False
    activation_offload: bool = False
    mlp_shards: int = 1
    liger: bool = False
    flash_ce: bool = True
    row_tokens: int = 1
    softcap: bool = False
    image_tokens: int = 0  # language-model tokens that stand for image patches (vision-language models)


@dataclass(frozen=True)
class PassPeak:
    """Peak bytes of one pass: activations, logits with their temporaries, and which phase peaks."""

    activations: float
    logits: float
    phase: str

    @property
    def total(self) -> float:
        """Activations plus logits and temporaries."""
        return self.activations + self.logits


def calibrated(arch: Architecture) -> bool:
    """The model has a calibrated row: its family's, and (a vision-language model) its wrapper's too."""
    return arch.model_type in FAMILIES and (not arch.config_type or arch.config_type in FAMILIES)


def coeffs_for(arch: Architecture) -> tuple[LayerCoeffs, bool]:
    """The layer coefficients of an architecture family, and whether that family was measured."""
    coeffs = FAMILIES.get(arch.model_type)
    return (coeffs, True) if coeffs is not None else (LLAMA, False)


def mlp_width(arch: Architecture) -> int:
    """MLP intermediate width one token passes through (routed top-k plus shared experts in MoE layers)."""
    return arch.active_intermediate_size if arch.moe_layers else arch.intermediate_size


def _dims(arch: Architecture, p: Pass) -> tuple[int, int, int, float, int]:
    q, kv = arch.q_width, arch.kv_width
    f = mlp_width(arch)
    return arch.hidden_size, q, kv, f / max(1, p.mlp_shards), arch.head_dim


def layer_saved(arch: Architecture, p: Pass) -> float:
    """Bytes per token one decoder layer saves for backward without checkpointing."""
    c, _ = coeffs_for(arch)
    h, q, kv, f, _d = _dims(arch, p)
    hidden = 4 if p.liger else c.hidden  # liger RMSNorm keeps the bf16 input and rstd only
    mlp = 6 if p.liger else c.mlp  # liger SwiGLU recomputes the activation
    attention = (
        mla_saved(arch)
        if arch.mla
        else c.q * q + c.kv * kv + c.heads * arch.num_attention_heads + c.kv_heads * arch.num_key_value_heads
    )
    router = c.router_fp32 * h if arch.moe_layers else 0
    return hidden * h + attention + mlp * f + c.const + _routed(arch, MOE_SAVED) + router


def mla_saved(arch: Architecture) -> int:
    """Bytes per token multi-head latent attention saves for backward (DeepSeek-V2; saved-tensor census).

    The attention's query and key of every head (no-position and rotary parts), the value's storage (the
    latent's up-projection to keys and values), the output, the fp32 log-sum-exp, and the latent: its projection
    output, its RMSNorm's fp32 input, normalized copy and weighted copy.
    """
    a, rank = arch.num_attention_heads, arch.kv_lora_rank
    up = a * (arch.qk_nope_head_dim + arch.v_head_dim)
    out = a * arch.v_head_dim
    return 4 * arch.q_width + 2 * up + 2 * out + 10 * rank + 2 * arch.qk_rope_head_dim + 4 * a


def _routed(arch: Architecture, coeff: int) -> int:
    """Bytes per token for the k routed copies of the hidden state in an MoE layer (0 for dense)."""
    return coeff * arch.num_experts_per_tok * arch.hidden_size if arch.moe_layers else 0


def layer_backward_extra(arch: Architecture, p: Pass) -> float:
    """Bytes per token of one layer's backward beyond what it saved (measured)."""
    c, _ = coeffs_for(arch)
    h, _q, _kv, f, d = _dims(arch, p)
    routed = _routed(arch, c.moe_backward)
    if p.checkpointing:  # a dense MLP's recomputed forward writes act(gate) * up beside everything it saves
        mlp = 2 * f if arch.moe_layers else 4 * f  # an MoE layer recomputes one expert's slice at a time
        return max(6 * h, mlp + 2 * h) + 4 * d + 20 + routed
    return max(20 * h, 4 * f + 2 * h) + 4 * d + 20 + routed


def layer_forward_peak(arch: Architecture, p: Pass) -> float:
    """Bytes per token at the peak of one layer's forward without autograd (residual included; measured)."""
    c, _ = coeffs_for(arch)
    h, q, _kv, f, d = _dims(arch, p)
    attention = 6 * h + 10 * q if c.q_norm else 0
    experts = MOE_FORWARD * f + _routed(arch, MOE_SAVED) + 2 * h if arch.moe_layers else 0
    return max(14 * h, mlp_forward(c, f) + 8 * h, attention, experts) + 4 * d + 8


def mlp_forward(c: LayerCoeffs, f: float) -> float:
    """Bytes per token of the MLP's peak: ``act(gate) * up`` is written while both inputs are alive (three
    bf16 widths), and a fused gate_up projection (Phi-3) keeps both halves in one storage until the product is
    done (four)."""
    return (8 if c.fused_gate_up else 6) * f


def head_saved(arch: Architecture) -> float:
    """Bytes per token the final norm and the head keep for backward (fp32 copy, rstd, bf16 normalized, output)."""
    return 8 * arch.hidden_size + 4 + 4 * arch.head_dim


def saved_layers(arch: Architecture, p: Pass) -> float:
    """Bytes per token all decoder layers keep for backward (layer inputs only under checkpointing)."""
    layers = min(arch.num_hidden_layers, 2) if p.activation_offload else arch.num_hidden_layers
    if p.checkpointing:
        return layers * 2 * arch.hidden_size
    dense = min(layers, arch.num_hidden_layers - arch.moe_layers)  # first-k dense layers of an MoE model
    dense_saved = layer_saved(replace(arch, num_experts=0), p) if dense else 0.0
    return dense * dense_saved + (layers - dense) * layer_saved(arch, p)


def logits_bytes(p: Pass, hidden: int) -> float:
    """Logits and their temporaries at the peak of the pass (bytes, whole micro batch)."""
    t, v = p.tokens, p.vocab
    weight_grad = BF16 * v * hidden if p.backward else 0  # the fused backward's own head-gradient buffer
    if p.fused_kernels:
        chunk = FUSED_BYTES_PER_ENTRY[p.backward] * min(t, FUSED_CHUNK_TOKENS) * v
        return chunk + weight_grad + PER_TOKEN_LOGPROB * t
    packed = p.packed_copy and p.flash_ce  # the flash kernel takes 2-D logits: a padded batch is copied
    copies = BF16 * (1 + int(p.temperature_copy) + int(packed))
    entropy = Entropy.EAGER if packed and p.entropy is not Entropy.NONE else p.entropy
    extra = LOGIT_EXTRA[(entropy, p.backward)] * t * v
    if not p.flash_ce:
        rows = NO_FLASH_GRAD_BYTES * t if p.backward else BF16 * NO_FLASH_ROWS_LIVE * min(t, p.row_tokens)
        extra += rows * v
    if p.softcap:
        extra += SOFTCAP_BYTES[p.backward] * t * v
    if entropy is Entropy.CHUNKED:
        extra += CHUNK_BYTES_PER_ENTRY[p.backward] * min(t, p.entropy_chunk) * v
    if p.backward and p.entropy_checkpointing and entropy is not Entropy.NONE:
        extra = ENTROPY_CHECKPOINTED_GRAD * t * v
    return copies * t * v + extra + PER_TOKEN_LOGPROB * t


def pass_peak(arch: Architecture, p: Pass) -> PassPeak:
    """Peak activations and logits of one micro batch: the largest of the head, layer and vision-tower phases.

    A model with terms derived from its own code (``arch.traced``) takes them; a family with a calibrated row
    its byte formulas; any other, Llama's row."""
    if arch.traced is not None:
        return traced_peak(arch, arch.traced, p)
    t, h = p.tokens, arch.hidden_size
    logits = logits_bytes(p, h)
    vision_kept, vision_own = vision_bytes(arch, p)
    if not p.backward:
        head = PassPeak(2 * h * t + vision_kept, logits, "logits of the forward")
        layer = PassPeak(layer_forward_peak(arch, p) * t + vision_kept, 0.0, "one layer's forward")
        tower = PassPeak(vision_own, 0.0, "the vision tower's forward")
        return max((head, layer, tower), key=lambda x: x.total)
    kept = saved_layers(arch, p) * t + vision_kept
    head = PassPeak(kept + (head_saved(arch) + 2 * h) * t, logits, "start of backward (logits)")
    inner = layer_backward_extra(arch, p) + (layer_saved(arch, p) if p.checkpointing else 0)
    layer = PassPeak(kept + inner * t, 0.0, "backward of the last layer")
    tower = PassPeak(vision_own, 0.0, "backward of the vision tower")
    return max((head, layer, tower), key=lambda x: x.total)


def traced_peak(arch: Architecture, terms: TracedTerms, p: Pass) -> PassPeak:
    """``pass_peak`` from terms traced on the model's code: every layer of the real depth, in order, with its
    kind's terms (a backward peaks at some layer over the saved tensors of the layers below it)."""
    t = p.tokens
    vision_kept, vision_own = vision_bytes(arch, p)
    tower = PassPeak(vision_own, 0.0, "the vision tower's " + ("backward" if p.backward else "forward"))
    if not p.backward:
        f = terms.forward
        logits = _traced_logits(arch, f, p)
        layer = max((f.base if i == 0 else f.steady) + f.layer[k] for i, k in enumerate(terms.slots))
        head = PassPeak((f.steady + f.head) * t + vision_kept, logits, "logits of the forward")
        return max((head, PassPeak(layer * t + vision_kept, 0.0, "one layer's forward"), tower), key=_total)
    pt = terms.checkpointed if p.checkpointing else terms.full
    slots = terms.slots[-2:] if p.activation_offload else terms.slots  # offloaded: two layers' tensors on GPU
    kept, layer = pt.base, 0.0
    for k in slots:
        layer = max(layer, kept + pt.rise[k], kept + pt.saved[k] + pt.layer[k])
        kept += pt.saved[k]
    head = PassPeak(
        (kept + pt.head) * t + vision_kept, _traced_logits(arch, pt, p), "start of backward (logits)"
    )
    return max((head, PassPeak(layer * t + vision_kept, 0.0, "backward of a layer"), tower), key=_total)


def _traced_logits(arch: Architecture, pt: PassTerms, p: Pass) -> float:
    """The logits of the pass as verl processes them, plus the copies the model's own head makes (softcapping)."""
    extra = max(0.0, pt.logit_extra) * p.tokens * p.vocab if p.vocab > 1 else 0.0
    return logits_bytes(replace(p, softcap=False), arch.hidden_size) + extra


def _total(peak: PassPeak) -> float:
    return peak.total


def vision_bytes(arch: Architecture, p: Pass) -> tuple[float, float]:
    """The vision tower's activations for the micro batch's image patches: what stays alive while the language
    model runs (saved block inputs or tensors, the merged embeddings), and the tower's own peak (its forward, or
    the backward of its last block). A block is costed as a Llama layer at the tower's width (not traced)."""
    v = arch.vision
    if v is None or not p.image_tokens:
        return 0.0, 0.0
    patches = p.image_tokens * v.merge
    hv, fv = v.hidden_size, v.intermediate_size
    saved = LLAMA.hidden * hv + (LLAMA.q + LLAMA.kv) * hv + LLAMA.mlp * fv + LLAMA.const
    merged = BF16 * v.out_hidden_size * p.image_tokens
    if not p.backward:
        return merged, merged + patches * (max(14 * hv, 6 * fv + 8 * hv) + 8)
    per_block = BF16 * hv if p.checkpointing else saved
    kept = patches * v.depth * per_block + merged
    recompute = saved if p.checkpointing else 0
    return kept, kept + patches * (max(6 * hv, 4 * fv + 2 * hv) + recompute)


def layer_params(arch: Architecture) -> int:
    """Parameters of one decoder layer (the largest kind when traced)."""
    if arch.traced is not None:
        return max(arch.traced.slot_params)
    h, n = arch.hidden_size, arch.num_hidden_layers
    embed = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return (arch.params - embed - h - vision_params(arch)) // max(1, n)


def vision_params(arch: Architecture) -> int:
    """Parameters of a vision-language model's vision tower and projector (0 for a text model)."""
    if arch.traced is not None:
        return arch.traced.vision_params
    return arch.vision.params if arch.vision else 0


def root_params(arch: Architecture, value_head: bool = False) -> int:
    """Parameters outside the decoder layers: embeddings, head (or a value head), final norm, vision tower."""
    h, v = arch.hidden_size, arch.vocab_size
    head = h if value_head else (0 if arch.tie_word_embeddings else v * h)
    return v * h + head + h + vision_params(arch)


def model_params(arch: Architecture, value_head: bool = False) -> int:
    """All parameters (a value head replaces the LM head for the critic)."""
    if arch.traced is not None:
        head = arch.traced.head_params
        return arch.traced.params - head + (arch.hidden_size if value_head else head)
    return layer_params(arch) * arch.num_hidden_layers + root_params(arch, value_head)


def lora_params(arch: Architecture, rank: int, all_linear: bool = True) -> int:
    """LoRA adapter parameters: rank × (in + out) per adapted linear of every layer."""
    h, f = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    attn = (h + q) + 2 * (h + kv) + (q + h)
    mlp = 3 * (h + f) if all_linear else 0
    return rank * (attn + mlp) * arch.num_hidden_layers


def kv_bytes_per_token(arch: Architecture, tp: int, dtype_bytes: int = BF16) -> int:
    """KV-cache bytes per token on one TP rank: K and V of every layer (KV heads replicated when fewer than TP).

    Multi-head latent attention caches the compressed latent and the rotary key instead, one per token per layer,
    on every TP rank (vLLM's MLA backends)."""
    if arch.mla:
        return arch.num_hidden_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * dtype_bytes
    heads = max(1, -(-arch.num_key_value_heads // max(1, tp)))
    return 2 * arch.num_hidden_layers * heads * arch.head_dim * dtype_bytes


def engine_activation_bytes(arch: Architecture, tp: int, batched_tokens: int, max_seqs: int) -> float:
    """The inference engine's profiled peak: one forward of ``batched_tokens`` plus sampling ``max_seqs`` rows."""
    h, f = arch.hidden_size, mlp_width(arch)
    q = arch.num_attention_heads * arch.head_dim
    per_token = BF16 * (4 * h + (4 * f + 2 * q) / max(1, tp))
    sampler = 3 * FP32 * max_seqs * arch.vocab_size
    return per_token * batched_tokens + sampler

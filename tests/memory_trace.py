"""The memory model's calibration cases: trace the real transformers modules on fake tensors, and estimate.

Shared by tests/test_memory_calibration.py (one small case, and the cached grid) and bench/calibrate_memory.py
(the full grid, variants and census; it keeps the traced results in bench/memory_calibration.json).

Each case builds a model from an architecture in the bundled table (no weights) inside ``FakeTensorMode`` with
bf16 parameters (what FSDP mixed precision computes in), runs one micro batch the way verl does, and records the
peak of activation and temporary memory (parameters and their gradients are excluded: the estimator shards them
analytically). Attention is ``scaled_dot_product_attention`` with causal masking and native GQA (the memory
pattern of flash attention: output plus fp32 log-sum-exp); the log-probs use a stand-in for flash-attn's
cross-entropy kernel with the same allocations (fp32 loss and log-sum-exp per token, gradient written in place).
Every sequence is at full length (the remove-padding worst case): ``micro × seq`` tokens.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / "memory_calibration.json"
PUBLISHED_CONFIGS = Path(__file__).resolve().parent / "data" / "model_configs.json"
MODELS = ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "meta-llama/Llama-3.1-8B", "Qwen/Qwen3-0.6B")
MICROS = (1, 4, 8)
SEQS = (512, 2048)
MODES = (("logprob", False), ("update", True), ("update", False))
VARIANTS = (
    "value_head",
    "eager_entropy",
    "chunked_entropy",
    "checkpointed_entropy",
    "temperature",
    "no_remove_padding",
    "fused_kernels",
    "no_flash_ce",
    "no_flash_ce_padded",
)


@dataclass(frozen=True)
class Case:
    """One traced configuration."""

    model: str
    micro: int
    seq: int
    mode: str
    ckpt: bool
    variant: str = "default"
    layers: int = 0  # decoder layers traced (0: all of the model's)

    @property
    def key(self) -> str:
        ck = "ckpt" if self.ckpt else "nockpt"
        depth = f"|L{self.layers}" if self.layers else ""
        return f"{self.model}|{self.mode}|b{self.micro}|s{self.seq}|{ck}|{self.variant}{depth}"

    @property
    def tokens(self) -> int:
        return self.micro * self.seq


def grid(models: tuple[str, ...] = MODELS) -> list[Case]:
    """The calibration grid: models × micro × seq × (log-prob, update with and without checkpointing)."""
    return [Case(m, b, s, mode, ckpt) for m in models for mode, ckpt in MODES for s in SEQS for b in MICROS]


def variant_cases() -> list[Case]:
    """Post-processing variants on Qwen2.5-0.5B, 4 × 512 tokens, forward-only and update (the critic's value
    head also without checkpointing)."""
    out = []
    for v in VARIANTS:
        modes = [("update", True)] if v == "checkpointed_entropy" else [("logprob", False), ("update", True)]
        if v == "value_head":
            modes.append(("update", False))
        out += [Case("Qwen/Qwen2.5-0.5B", 4, 512, mode, ckpt, v) for mode, ckpt in modes]
    return out + FEATURE_CASES


# Architecture features and logits paths on the models where users hit them: Qwen2.5-3B without flash-attn's
# cross-entropy, gemma-2-2b's final-logit softcapping, Mixtral-8x7B's routed experts.
FEATURE_CASES = [
    Case("Qwen/Qwen2.5-3B", 8, 1024, "logprob", True, "no_flash_ce_padded"),
    Case("Qwen/Qwen2.5-3B", 8, 1024, "logprob", True, "no_flash_ce"),
    Case("google/gemma-2-2b", 2, 1024, "logprob", True),
    Case("google/gemma-2-2b", 2, 1024, "update", True),
    Case("google/gemma-2-2b", 2, 1024, "update", False),
    Case("mistralai/Mixtral-8x7B-v0.1", 1, 1024, "logprob", True),
    Case("mistralai/Mixtral-8x7B-v0.1", 1, 1024, "update", True),
    Case("mistralai/Mixtral-8x7B-v0.1", 1, 1024, "update", False),
    Case("synthetic/qwen3-moe-8L", 1, 1024, "update", True),
    Case("synthetic/qwen3-moe-8L", 1, 1024, "update", False),
    # Phi-3-mini without flash-attn's cross-entropy (a 32k vocabulary: the row-wise log-softmax beside the layers)
    Case("microsoft/Phi-3-mini-4k-instruct", 4, 1024, "logprob", False, "no_flash_ce", layers=2),
    Case("microsoft/Phi-3-mini-4k-instruct", 4, 1024, "update", True, "no_flash_ce", layers=2),
]


# Families nobody calibrated the terms on, each at two shapes and every stage, traced with few layers (a layer's
# terms scale with the token count, not the depth; the depth multiplies only the saved inputs, which the estimate
# takes at the traced depth too). Mistral-7B and Phi-3-mini have 32k vocabularies: the layer, not the logits,
# sets their forward peak, so a large vocabulary cannot hide a layer term's error.
FAMILY_MODELS = (
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen2.5-14B",
    "mistralai/Mistral-7B-v0.1",
    "microsoft/Phi-3-mini-4k-instruct",
    "Qwen/Qwen1.5-MoE-A2.7B",
    "deepseek-ai/DeepSeek-V2-Lite",
    "Qwen/Qwen2.5-VL-7B-Instruct",
    "google/gemma-2-2b",
)
FAMILY_SHAPES = ((1, 8192), (4, 1024))  # two token counts, one long sequence and a batch of shorter ones
FAMILY_LAYERS = 2
# The full-depth table: every family at its real depth, two shapes, every stage. Families with a calibrated row
# (the first ten) and families nobody calibrated (GLM-4, OLMo-2, Gemma-3 text and vision, LLaVA-1.5): the
# estimate takes the row for the first and terms derived from the model's code for the others.
FULL_MODELS = (
    "meta-llama/Llama-3.1-8B",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen3-8B",
    "mistralai/Mistral-7B-v0.1",
    "google/gemma-2-2b",
    "microsoft/Phi-3-mini-4k-instruct",
    "mistralai/Mixtral-8x7B-v0.1",
    "Qwen/Qwen1.5-MoE-A2.7B",
    "deepseek-ai/DeepSeek-V2-Lite",
    "Qwen/Qwen2.5-VL-7B-Instruct",
    "THUDM/GLM-4-9B-0414",
    "allenai/OLMo-2-0425-1B",
    "google/gemma-3-1b-it",
    "google/gemma-3-4b-it",
    "llava-hf/llava-1.5-7b-hf",
)


def family_cases(models: tuple[str, ...] = FAMILY_MODELS) -> list[Case]:
    """Every family × two shapes × (log-prob, update with and without checkpointing), at FAMILY_LAYERS."""
    return [
        Case(m, b, s, mode, ckpt, layers=FAMILY_LAYERS)
        for m in models
        for mode, ckpt in MODES
        for b, s in FAMILY_SHAPES
    ]


def full_cases(models: tuple[str, ...] = FULL_MODELS) -> list[Case]:
    """Every family at full depth × two shapes × (log-prob, update with and without checkpointing)."""
    return [Case(m, b, s, mode, ckpt) for m in models for mode, ckpt in MODES for b, s in FAMILY_SHAPES]


# Models outside the bundled table come from transformers' own config classes, so the trace and the estimate
# read the same numbers: MistralConfig, Phi3Config and Qwen2MoeConfig default to Mistral-7B-v0.1, Phi-3-mini and
# Qwen1.5-MoE-A2.7B; DeepSeek-V2-Lite and Qwen2.5-VL-7B-Instruct pass their published config.json numbers
# (huggingface.co/deepseek-ai/DeepSeek-V2-Lite and Qwen/Qwen2.5-VL-7B-Instruct, config.json).
DEEPSEEK_V2_LITE: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=2,
    n_routed_experts=64,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=102400,
    max_position_embeddings=163840,
    tie_word_embeddings=False,
)
QWEN25_VL_7B: dict[str, Any] = dict(
    text_config=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=128000,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]),
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
    ),
    tie_word_embeddings=False,
)
FROM_TRANSFORMERS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistralai/Mistral-7B-v0.1": ("MistralConfig", {}),
    "microsoft/Phi-3-mini-4k-instruct": ("Phi3Config", {}),
    "Qwen/Qwen1.5-MoE-A2.7B": ("Qwen2MoeConfig", {}),
    "deepseek-ai/DeepSeek-V2-Lite": ("DeepseekV2Config", DEEPSEEK_V2_LITE),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("Qwen2_5_VLConfig", QWEN25_VL_7B),
}


def transformers_config(model: str) -> Any:
    """The transformers config object of a model outside the bundled table."""
    import transformers

    name, kwargs = FROM_TRANSFORMERS[model]
    return getattr(transformers, name)(**kwargs)


def config_dict(model: str) -> dict[str, Any]:
    """What the model's config.json holds (as transformers writes it)."""
    data: dict[str, Any] = transformers_config(model).to_dict()
    return data


# ----------------------------------------------------------------------------------------------- estimate side


# A Qwen3-MoE-shaped config (128 experts, top-8, expert width 768; 8 layers to keep the trace short): it checks
# the MoE terms at a routing shape far from Mixtral's, not any published model's numbers.
SYNTHETIC = {
    "synthetic/qwen3-moe-8L": dict(
        hidden_size=2048,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=6144,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        head_dim=128,
        model_type="qwen3_moe",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    )
}


def architecture(model: str) -> Any:
    """The architecture numbers from the bundled table (or a synthetic shape above)."""
    sys.path.insert(0, str(ROOT))
    from verl_safe_launch.context import Architecture
    from verl_safe_launch.inputs import from_config_dict, load_architecture

    if model in SYNTHETIC:
        return Architecture(name=model, source="synthetic", **SYNTHETIC[model])  # type: ignore[arg-type]
    if model in FROM_TRANSFORMERS:
        return from_config_dict(config_dict(model), model, "transformers config class")
    if model in published():
        return from_config_dict(config_of(model), model, "published config.json")

    arch = load_architecture(model)
    if arch is None:
        raise SystemExit(f"unknown model {model}")
    return arch


def resolved(model: str, method: str = "product") -> Any:
    """The architecture with the terms the estimate uses: ``product`` as the estimator picks them (a calibrated
    row, else derived from the code), ``derived`` always derived, or ``row:<family>`` a family's row standing in."""
    from verl_safe_launch.memory.derive import with_traced
    from verl_safe_launch.memory.sources import resolve

    arch = architecture(model)
    if method == "product":
        return resolve(arch).arch
    if method == "derived":
        derived, why = with_traced(arch)
        if derived.traced is None:
            raise RuntimeError(f"{model}: {why}")
        return derived
    return replace(arch, model_type=method.split(":", 1)[1], traced=None)


def at_depth(arch: Any, layers: int) -> Any:
    """The architecture cut to its first ``layers`` decoder layers (their kinds too, when traced)."""
    traced = arch.traced
    if traced is not None:
        traced = replace(traced, slots=traced.slots[:layers])
    return replace(arch, num_hidden_layers=layers, traced=traced)


def estimate(case: Case, layers: int | None = None, method: str = "product") -> tuple[float, float]:
    """(activations, logits and temporaries) in bytes from the memory model."""
    from verl_safe_launch.memory import Entropy, Pass, pass_peak
    from verl_safe_launch.memory.terms import traced_peak

    arch = resolved(case.model, method)
    layers = layers or case.layers
    if layers:
        arch = at_depth(arch, layers)
    vocab = 1 if case.variant == "value_head" else arch.vocab_size
    p = Pass(tokens=case.tokens, backward=case.mode == "update", vocab=vocab, checkpointing=case.ckpt)
    v = case.variant
    if v == "eager_entropy":
        p = replace(p, entropy=Entropy.EAGER)
    elif v == "chunked_entropy":
        p = replace(p, entropy=Entropy.CHUNKED, entropy_chunk=512)
    elif v == "checkpointed_entropy":
        p = replace(p, entropy=Entropy.EAGER, entropy_checkpointing=True)
    elif v == "temperature":
        p = replace(p, temperature_copy=True)
    elif v == "no_remove_padding":
        p = replace(p, packed_copy=True)
    elif v == "fused_kernels":
        p = replace(p, fused_kernels=True)
    elif v == "no_flash_ce":
        p = replace(p, flash_ce=False)
    elif v == "no_flash_ce_padded":
        p = replace(p, flash_ce=False, packed_copy=True, row_tokens=case.seq)
    if arch.final_logit_softcapping and v != "value_head":
        p = replace(p, softcap=True)
    peak = traced_peak(arch, arch.traced, p) if arch.traced is not None else pass_peak(arch, p)
    return peak.activations, peak.logits


# -------------------------------------------------------------------------------------------------- trace side


def config_of(model: str) -> dict[str, Any]:
    """The config.json mapping a model is built from: a published config, a transformers config class's
    defaults, a synthetic shape, or the bundled table."""
    if model in published():
        return dict(published()[model]["config"])
    if model in FROM_TRANSFORMERS:
        return config_dict(model)
    if model in SYNTHETIC:
        return dict(SYNTHETIC[model])
    sys.path.insert(0, str(ROOT))
    from verl_safe_launch.inputs.architecture import bundled_table

    return dict(bundled_table()[model])


@functools.cache
def published() -> dict[str, Any]:
    """tests/data/model_configs.json: configs of published models outside the bundled table."""
    data: dict[str, Any] = json.loads(PUBLISHED_CONFIGS.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def hf_config(arch: Any, layers: int | None = None, vocab: int | None = None) -> Any:
    """The model's transformers config (its own config class, defaults filled), cut to ``layers`` decoder
    layers (and ``vocab``), attention through the tracing kernel."""
    from verl_safe_launch.memory import trace as product

    cfg = product.hf_config(config_of(arch.name))
    text = getattr(cfg, "text_config", None) or cfg
    if layers:
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:layers]
    if vocab:
        text.vocab_size = vocab
    product.set_attention(cfg)
    return cfg


def register_attention() -> None:
    """Causal SDPA with native GQA (the product tracer's kernel)."""
    from verl_safe_launch.memory import trace as product

    product.register_attention()


def flash_ce() -> Any:
    """Stand-in for flash_attn's cross_entropy_loss (the product tracer's)."""
    from verl_safe_launch.memory import trace as product

    return product.flash_ce()


def eager_entropy(logits: Any) -> Any:
    """verl's entropy_from_logits under CUDA autocast: softmax and the product run in fp32."""
    import torch

    pd = torch.softmax(logits.float(), dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def chunked_entropy(logits: Any, chunk: int) -> Any:
    """verl's entropy_from_logits_with_chunking."""
    import torch

    out = torch.zeros(logits.shape[0], device=logits.device)
    for i in range(0, logits.shape[0], chunk):
        part = logits[i : i + chunk].float()
        pd = torch.softmax(part, dim=-1)
        out[i : i + chunk] = torch.logsumexp(part, dim=-1) - torch.sum(pd * part, dim=-1)
    return out


def make_tracker(model: Any, vocab: int) -> Any:
    """The product tracer's MemTracker: the peak of activations + temporaries, weight gradients set apart."""
    from verl_safe_launch.memory import trace as product

    return product.make_tracker(model, vocab)


def trace(case: Case, layers: int | None = None, vocab: int | None = None) -> dict[str, Any]:
    """Trace one case on fake tensors; returns the peak of activations + temporaries and the logits part (bytes)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    register_attention()
    arch = architecture(case.model)
    cfg = hf_config(arch, layers or case.layers, vocab)
    start = time.perf_counter()
    with FakeTensorMode():
        model = _build(cfg, case.ckpt, value_head=case.variant == "value_head")
        grad = case.mode == "update"
        model.train(grad)
        vocab_size = getattr(cfg, "text_config", cfg).vocab_size
        ids = torch.randint(0, vocab_size, (case.micro, case.seq))
        tracker = make_tracker(model, -1 if case.variant == "value_head" else vocab_size)
        tracker.track_external(model)
        with tracker, torch.set_grad_enabled(grad):
            loss = _forward(model, ids, case.variant, vocab_size)
            if grad:
                tracker.backward = True
                loss.backward()
            tracker.sample("end")
    return {
        "traced_total": int(tracker.peak),
        "traced_logits": int(tracker.peak_logits),
        "peak_op": tracker.peak_op,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _build(cfg: Any, ckpt: bool, value_head: bool = False) -> Any:
    """The model in bf16 (the product tracer's build); with ``value_head`` the critic's one-label model."""
    from verl_safe_launch.memory import trace as product

    model = product.build_model(cfg, value_head=value_head)
    if ckpt:
        product.set_checkpointing(model, True)
    return model


def _forward(model: Any, ids: Any, variant: str, vocab: int) -> Any:
    """One micro batch the way verl's FSDP engine processes it, ending in a scalar loss."""
    import torch

    labels = ids.reshape(-1)
    if variant == "value_head":
        return model(input_ids=ids, use_cache=False).logits.float().sum()
    if variant == "fused_kernels":
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        log_probs, entropy = FusedLinearForPPO()(
            hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels
        )
        return log_probs.sum() + entropy.sum()
    raw = model(input_ids=ids, use_cache=False).logits
    if variant.startswith("no_flash_ce"):
        from verl.utils.torch_functional import logprobs_from_logits_v2

        # verl's fallback when flash-attn's cross-entropy is missing: remove padding hands it 2-D logits (a row
        # per token); a padded batch keeps them 3-D (a row per sequence)
        padded = variant == "no_flash_ce_padded"
        rows = raw if padded else raw.reshape(-1, vocab)
        log_probs = logprobs_from_logits_v2(rows, ids if padded else labels)
        del raw, rows
        return log_probs.sum()
    logits = raw.reshape(-1, vocab)
    if variant == "temperature":
        logits = logits / 0.7
    elif variant == "no_remove_padding":
        logits = torch.cat(list(raw.unbind()))
    entropy = None
    if variant == "eager_entropy":
        entropy = eager_entropy(logits)
    elif variant == "chunked_entropy":
        entropy = chunked_entropy(logits, 512)
    elif variant == "checkpointed_entropy":
        entropy = torch.utils.checkpoint.checkpoint(eager_entropy, logits, use_reentrant=False)
    log_probs = flash_ce().apply(logits, labels, entropy is None)
    del raw, logits
    loss = log_probs.sum()
    return loss if entropy is None else loss + entropy.sum()


def load_cache() -> dict[str, Any]:
    """The traced results kept in bench/memory_calibration.json (empty when there are none)."""
    if CACHE.is_file():
        data: dict[str, Any] = json.loads(CACHE.read_text())
        return data
    return {"meta": {}, "cases": {}}

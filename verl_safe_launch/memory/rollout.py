"""The rollout stage: the inference engine's memory pool, its weights per rank, and the KV cache it leaves."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.context import Architecture
from verl_safe_launch.memory.terms import (
    BF16,
    DTYPE_BYTES,
    GIB,
    engine_activation_bytes,
    kv_bytes_per_token,
    model_params,
)
from verl_safe_launch.rules import BatchPlan, pos_int

R = f"{ARR}.rollout"
UTIL_KEY = f"{R}.gpu_memory_utilization"
MAX_MODEL_LEN_KEY = f"{R}.max_model_len"
TP_KEY = f"{R}.tensor_model_parallel_size"
MAX_SEQS_KEY = f"{R}.max_num_seqs"
S = TypeVar("S")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
CUDA_GRAPHS_GIB = 1.0
"""Captured CUDA graphs (modelled, not traced: vLLM measures them on the GPU at start-up, 0.3-1.6 GiB in published
logs). vLLM >= 0.21 (verl 0.9.1 pins 0.24) profiles them and takes them from the gpu_memory_utilization share;
with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0, or SGLang, they come on top of it."""
GRAPHS_ENV_KEY = "ray_kwargs.ray_init.runtime_env.env_vars.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"


@dataclass(frozen=True)
class RolloutFacts:
    """The rollout engine's memory on one GPU (bytes) and the KV-cache capacity (tokens) it leaves."""

    engine: str
    tp: int
    util: float
    pool_bytes: float | None
    weights_bytes: float
    activation_bytes: float
    graphs_bytes: float
    graphs_inside: bool
    """The engine takes its CUDA graphs from its memory share (vLLM's own accounting) rather than on top."""
    kv_bytes_per_token: int
    max_model_len: int
    max_model_len_from_model: bool
    seq_len: int
    concurrency: int
    asleep: bool

    @property
    def kv_bytes(self) -> float | None:
        """What the pool leaves for the KV cache after weights and the profiled activation peak."""
        if self.pool_bytes is None:
            return None
        return self.pool_bytes - self.weights_bytes - self.activation_bytes - self.graphs_in_pool

    @property
    def graphs_in_pool(self) -> float:
        """CUDA graph bytes taken from the engine's share (0 when they come on top of it)."""
        return self.graphs_bytes if self.graphs_inside else 0.0

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the KV cache holds on one replica (None when the GPU size is unknown)."""
        kv = self.kv_bytes
        return None if kv is None else max(0, int(kv // self.kv_bytes_per_token))

    @property
    def wanted_tokens(self) -> int:
        """Tokens the replica needs to run its share of sequences concurrently at full length."""
        return self.concurrency * self.seq_len

    def util_for(self, tokens: int, gpu: float) -> float:
        """The memory fraction that leaves room for ``tokens`` of KV cache (vLLM's fraction of total memory)."""
        need = (
            self.weights_bytes
            + self.activation_bytes
            + self.graphs_in_pool
            + tokens * self.kv_bytes_per_token
        )
        return need / (gpu * GIB)

    @property
    def assumptions(self) -> tuple[str, ...]:
        """The rollout lines of the assumptions."""
        share = "of free memory at start-up" if self.engine == "SGLang" else "of total GPU memory"
        src = "null: the model's max_position_embeddings" if self.max_model_len_from_model else "set"
        return (
            f"rollout ({self.engine}): gpu_memory_utilization {self.util:g} {share}; weights / TP {self.tp}; "
            f"max_model_len {self.max_model_len} ({src}); CUDA graphs "
            + (
                "none (enforce_eager)"
                if not self.graphs_bytes
                else f"~{self.graphs_bytes / GIB:g} GiB {'within that share' if self.graphs_inside else 'on top of it'}"
                " (modelled, not traced: the engine measures them on the GPU at start-up)"
            ),
            "rollout weights: the model's parameters / TP in the rollout dtype (exact count); engine activations: "
            "one forward of max_num_batched_tokens plus the sampler (modelled, not traced)",
        )


def _num(view: ConfigView, key: str, default: float) -> float:
    value = view.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def rollout_facts(
    view: ConfigView, plan: BatchPlan, arch: Architecture, gpu: float | None, resident: float
) -> RolloutFacts:
    """The rollout engine's numbers; ``resident`` is what training state and contexts hold when it starts."""
    name = str(view.get(f"{R}.name") or "vllm")
    engine = ENGINE_NAMES.get(name, name)
    tp, pp = plan.rollout_tp or 1, plan.rollout_pp or 1
    util = _num(view, UTIL_KEY, 0.5)
    mml = pos_int(view.get(MAX_MODEL_LEN_KEY))
    max_len = mml or arch.max_position_embeddings or (plan.max_seq_len or 0)
    batched = pos_int(view.get(f"{R}.max_num_batched_tokens")) or 8192
    if view.get(f"{R}.enable_chunked_prefill") is False:
        batched = max(batched, max_len)  # vLLM raises it to max_model_len without chunked prefill
    seqs = pos_int(view.get(MAX_SEQS_KEY)) or 256
    pool = None
    if gpu is not None:
        total = gpu * GIB
        pool = util * (total - resident) if name == "sglang" else util * total
    eager = view.get(f"{R}.enforce_eager") is True
    width = DTYPE_BYTES.get(str(view.get(f"{R}.dtype") or "bf16").lower(), BF16)
    return RolloutFacts(
        engine=engine,
        tp=tp,
        util=util,
        pool_bytes=pool,
        weights_bytes=width * model_params(arch) / (tp * pp),
        activation_bytes=engine_activation_bytes(arch, tp, batched, seqs),
        graphs_bytes=0.0 if eager else CUDA_GRAPHS_GIB * GIB,
        graphs_inside=name == "vllm" and str(view.get(GRAPHS_ENV_KEY)) != "0",
        kv_bytes_per_token=kv_bytes_per_token(arch, tp, width),
        max_model_len=max_len,
        max_model_len_from_model=mml is None,
        seq_len=plan.max_seq_len or max_len,
        concurrency=min(seqs, plan.sequences_per_replica or seqs),
        asleep=view.get(f"{R}.free_cache_engine") is not False,
    )


Finish = Callable[[str, Mapping[str, float], str, str, str | None], S]


def rollout_stage(
    facts: RolloutFacts, base: Mapping[str, float], overhead_gib: float, finish: Finish[S]
) -> S:
    """The rollout stage estimate: training state still resident + the engine's pool (+ graphs, contexts)."""
    parts = dict(base)
    parts["parameters"] = parts.get("parameters", 0.0) + facts.weights_bytes
    parts["activations"] = facts.activation_bytes
    parts["fixed overhead"] = overhead_gib * GIB + facts.graphs_bytes
    kv = facts.kv_bytes
    if kv is not None:
        parts["KV cache"] = max(0.0, kv)
        phase = f"KV cache holds {facts.capacity_tokens} tokens per replica"
    else:
        phase = "KV cache fills the memory fraction (GPU size unknown)"
    batch = f"gpu_memory_utilization {facts.util:g}, TP {facts.tp}"
    return finish("rollout", parts, phase, batch, UTIL_KEY)

"""What the memory model reads from the config: each training role's engine settings and each stage's batch."""

from __future__ import annotations

from dataclasses import dataclass

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.context import Architecture
from verl_safe_launch.memory.terms import DTYPE_BYTES, Entropy, Pass, lora_params, model_params
from verl_safe_launch.rules import BatchPlan, effective_sp, pos_int

MODEL = {"actor": f"{ARR}.model", "ref": f"{ARR}.model", "critic": "critic.model"}
FSDP = {"actor": f"{ARR}.actor.fsdp_config", "ref": f"{ARR}.ref.fsdp_config", "critic": "critic.fsdp"}
STRATEGY = {"actor": f"{ARR}.actor.strategy", "ref": f"{ARR}.ref.strategy", "critic": "critic.strategy"}
CRITIC_V1_BUDGET = "critic.ppo_infer_max_token_len_per_gpu"
CRITIC_V1_BUDGET_DEFAULT = 32768  # the CriticConfig dataclass default (the key is not in verl's YAML)


@dataclass(frozen=True)
class Engine:
    """One training role's FSDP engine, as far as memory goes."""

    role: str
    arch: Architecture
    shards: int
    dtype_bytes: int
    param_offload: bool
    optimizer_offload: bool
    cpu_policy: bool
    forward_only: bool
    sp: int
    lora_rank: int
    checkpointing: bool
    activation_offload: bool
    remove_padding: bool
    fused_kernels: bool
    liger: bool
    mlp_shards: int
    compile_entropy: bool
    entropy_chunking: bool
    entropy_chunk: int
    entropy_checkpointing: bool
    reshard_after_forward: bool
    forward_prefetch: bool
    megatron: bool
    flash_ce: bool = True

    @property
    def value_head(self) -> bool:
        """The critic's model ends in a one-output value head instead of the vocabulary."""
        return self.role == "critic"

    @property
    def params(self) -> int:
        """Parameters held by the engine (LoRA adapters included)."""
        return model_params(self.arch, self.value_head) + self.lora_params

    @property
    def lora_params(self) -> int:
        """Adapter parameters (0 without LoRA)."""
        return lora_params(self.arch, self.lora_rank) if self.lora_rank else 0

    @property
    def trainable(self) -> int:
        """Parameters with gradients and optimizer state: the adapters under LoRA, else all."""
        return self.lora_params if self.lora_rank else self.params


@dataclass(frozen=True)
class StageSpec:
    """One training stage: which engine runs it, forward only or not, and what sizes its micro batch."""

    name: str
    engine: Engine
    backward: bool
    knob: str
    dynamic: bool
    micro: int | None
    budget: int | None
    entropy: bool
    temperature: bool

    def tokens(self, seq_len: int) -> int:
        """Tokens per GPU in one micro batch: the token budget, or micro × (prompt + response) / sp."""
        if self.dynamic:
            return self.budget or seq_len
        return max(1, (self.micro or 1) * seq_len // max(1, self.engine.sp))

    def describe(self, seq_len: int) -> str:
        """How the micro batch is sized, in words."""
        sp = f" / sp {self.engine.sp}" if self.engine.sp > 1 else ""
        if self.dynamic:
            return f"token budget {self.tokens(seq_len)} per GPU ({self.knob})"
        micro = "1 (unset)" if self.micro is None else str(self.micro)
        return f"{micro} × {seq_len} tokens{sp} = {self.tokens(seq_len)} tokens per GPU ({self.knob})"


def _flag(view: ConfigView, key: str) -> bool:
    return view.get(key) is True


def _int(view: ConfigView, key: str, default: int) -> int:
    return pos_int(view.get(key)) or default


def read_engine(view: ConfigView, role: str, arch: Architecture, gpus: int) -> Engine:
    """The memory-relevant settings of one role (actor, ref or critic)."""
    fsdp, model = FSDP[role], MODEL[role]
    size = view.get(f"{fsdp}.fsdp_size")
    shards = size if isinstance(size, int) and 0 < size <= gpus else gpus
    forward_only = role == "ref" or _flag(view, f"{fsdp}.forward_only")
    dtype = view.get(f"{fsdp}.model_dtype") or ("bf16" if forward_only else "fp32")
    strategy = view.get(STRATEGY[role])
    lora = pos_int(view.get(f"{model}.lora_rank")) or pos_int(view.get(f"{model}.lora.rank")) or 0
    tiled = _flag(view, f"{model}.tiled_mlp.enabled")
    return Engine(
        role=role,
        arch=arch,
        shards=max(1, shards),
        dtype_bytes=DTYPE_BYTES.get(str(dtype).lower(), 4),
        param_offload=_flag(view, f"{fsdp}.param_offload"),
        optimizer_offload=_flag(view, f"{fsdp}.optimizer_offload"),
        cpu_policy=forward_only or (strategy == "fsdp2" and _flag(view, f"{fsdp}.offload_policy")),
        forward_only=forward_only,
        sp=effective_sp(view, role) or 1,
        lora_rank=lora,
        checkpointing=view.get(f"{model}.enable_gradient_checkpointing") is not False,
        activation_offload=_flag(view, f"{model}.enable_activation_offload"),
        remove_padding=view.get(f"{model}.use_remove_padding") is not False,
        fused_kernels=_flag(view, f"{model}.use_fused_kernels"),
        liger=_flag(view, f"{model}.use_liger"),
        mlp_shards=_int(view, f"{model}.tiled_mlp.num_shards", 4) if tiled else 1,
        compile_entropy=view.get(f"{fsdp}.use_torch_compile") is not False,
        entropy_chunking=_flag(view, f"{fsdp}.entropy_from_logits_with_chunking"),
        entropy_chunk=_int(view, f"{fsdp}.entropy_from_logits_chunk_size", 2048),
        entropy_checkpointing=_flag(view, f"{fsdp}.entropy_checkpointing"),
        reshard_after_forward=view.get(f"{fsdp}.reshard_after_forward") is not False,
        forward_prefetch=_flag(view, f"{fsdp}.forward_prefetch"),
        megatron=str(view.get("model_engine")) == "megatron",
    )


def entropy_mode(engine: Engine, wanted: bool) -> Entropy:
    """How the engine computes entropy when the stage asks for it."""
    if not wanted:
        return Entropy.NONE
    if engine.entropy_chunking:
        return Entropy.CHUNKED
    return Entropy.COMPILED if engine.compile_entropy else Entropy.EAGER


def make_pass(spec: StageSpec, tokens: int, seq_len: int = 1, prompt_len: int = 0) -> Pass:
    """The per-micro-batch description the byte formulas take (``seq_len``: one padded sequence per GPU).

    A vision-language model's images fill the prompts (the worst case, as every sequence is at full length)."""
    e = spec.engine
    images = tokens * min(prompt_len, seq_len) // max(1, seq_len) if e.arch.vision else 0
    return Pass(
        tokens=tokens,
        backward=spec.backward,
        vocab=1 if e.value_head else e.arch.vocab_size,
        checkpointing=e.checkpointing,
        entropy=entropy_mode(e, spec.entropy),
        entropy_chunk=e.entropy_chunk,
        entropy_checkpointing=e.entropy_checkpointing,
        temperature_copy=spec.temperature,
        packed_copy=not e.remove_padding and not e.value_head,
        fused_kernels=e.fused_kernels and not e.value_head,
        activation_offload=e.activation_offload and spec.backward,
        mlp_shards=e.mlp_shards,
        liger=e.liger,
        flash_ce=e.flash_ce,
        row_tokens=1 if e.remove_padding else max(1, seq_len // max(1, e.sp)),
        softcap=bool(e.arch.final_logit_softcapping) and not e.value_head,
        image_tokens=images,
    )


def _micro(view: ConfigView, key: str) -> int | None:
    return pos_int(view.get(key))


def stage_specs(
    view: ConfigView, plan: BatchPlan, actor: Engine, ref: Engine | None, critic: Engine | None
) -> list[StageSpec]:
    """The training stages this config runs, in step order."""
    temperature = view.get(f"{ARR}.rollout.temperature") not in (1, 1.0, None)
    a, r = f"{ARR}.actor", f"{ARR}.rollout"
    specs: list[StageSpec] = []
    if view.get("algorithm.rollout_correction.bypass_mode") is not True:
        dyn = _flag(view, f"{r}.log_prob_use_dynamic_bsz")
        key = f"{r}.log_prob_max_token_len_per_gpu" if dyn else f"{r}.log_prob_micro_batch_size_per_gpu"
        micro, budget = _micro(view, f"{r}.log_prob_micro_batch_size_per_gpu"), _micro(view, key)
        specs.append(StageSpec("old log-prob", actor, False, key, dyn, micro, budget, True, temperature))
    if ref is not None:
        dyn = _flag(view, f"{ARR}.ref.log_prob_use_dynamic_bsz")
        p = f"{ARR}.ref"
        key = f"{p}.log_prob_max_token_len_per_gpu" if dyn else f"{p}.log_prob_micro_batch_size_per_gpu"
        micro, budget = _micro(view, f"{p}.log_prob_micro_batch_size_per_gpu"), _micro(view, key)
        specs.append(StageSpec("ref log-prob", ref, False, key, dyn, micro, budget, False, temperature))
    dyn = plan.dynamic
    key = f"{a}.ppo_max_token_len_per_gpu" if dyn else f"{a}.ppo_micro_batch_size_per_gpu"
    entropy = _flag(view, f"{a}.calculate_entropy") or view.get(f"{a}.entropy_coeff") not in (0, 0.0, None)
    specs.append(
        StageSpec("actor update", actor, True, key, dyn, plan.micro, _micro(view, key), entropy, temperature)
    )
    if critic is not None:
        key = CRITIC_V1_BUDGET if plan.v1 else "critic.ppo_max_token_len_per_gpu"
        budget = _micro(view, key) or (CRITIC_V1_BUDGET_DEFAULT if plan.v1 else None)
        specs.append(StageSpec("critic", critic, True, key, True, None, budget, False, False))
    return specs

"""What every stage after composition reads: the config view, the model architectures and the hardware."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_safe_launch.config_view import ConfigView


@dataclass(frozen=True)
class VisionTower:
    """A vision-language model's vision encoder (Qwen2/2.5-VL's ``vision_config``): patches in, merged tokens out."""

    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    pooling: int = 1
    """Patches averaged into one token after the tower (Gemma-3 pools 64×64 patches to 16×16 tokens)."""

    @property
    def merge(self) -> int:
        """Patches per language-model token: merged (Qwen2/2.5-VL) or pooled (Gemma-3)."""
        return self.spatial_merge_size**2 * self.pooling

    @property
    def block_params(self) -> int:
        """One vision block: two norms, fused qkv and projection with biases, the gated MLP with biases."""
        hv, fv = self.hidden_size, self.intermediate_size
        mlp = 3 * hv * fv + 2 * fv + hv
        return 2 * hv + 3 * hv * hv + 3 * hv + hv * hv + hv + mlp

    @property
    def params(self) -> int:
        """Patch embedding, the blocks, and the merger into the language model's width."""
        hv, wide = self.hidden_size, self.hidden_size * self.spatial_merge_size**2
        embed = self.in_channels * self.temporal_patch_size * self.patch_size**2 * hv
        merger = hv + wide * wide + wide + wide * self.out_hidden_size + self.out_hidden_size
        return embed + self.depth * self.block_params + merger


@dataclass(frozen=True)
class PassTerms:
    """Bytes per token of one kind of pass, traced on the model's own modules (one layer of each kind).

    Per traced layer ``k``: ``base`` is alive before the first layer (embedding output, rotary tables),
    ``steady`` entering a later layer of a forward-only pass; ``saved[k]`` is what the layer leaves alive for the
    next (its output, what it saved for backward), ``layer[k]`` its peak above what is alive when it starts
    (forward only) or above the saved prefix
    (backward), ``rise[k]`` its forward peak above what is alive when it starts; ``head`` the peak after the
    last layer above what the layers keep, the logits apart, and ``logit_extra`` the model's own full-vocabulary
    copies beyond the plain bf16 logits (bytes per vocabulary entry).
    """

    base: float
    steady: float
    saved: tuple[float, ...]
    layer: tuple[float, ...]
    rise: tuple[float, ...]
    head: float
    logit_extra: float


@dataclass(frozen=True)
class TracedTerms:
    """What a trace of the model's own code gives the memory model: bytes per token per pass, exact parameters."""

    slots: tuple[int, ...]
    """For each decoder layer, the traced layer whose terms it takes: the first layer its own, every other the
    layer traced for its kind (sliding or global attention, dense or mixture-of-experts...)."""
    kinds: int
    forward: PassTerms
    checkpointed: PassTerms
    full: PassTerms
    params: int
    vision_params: int
    head_params: int
    """The LM head's own parameters (0 when tied to the embedding)."""
    slot_params: tuple[int, ...]
    model_class: str
    seconds: float
    cached: bool = False
    path: str = ""

    def describe(self) -> str:
        """How the terms were obtained, for the assumptions."""
        kinds = self.kinds
        what = f"{self.model_class}, {len(self.slots)} layers of {kinds} kind{'s' if kinds > 1 else ''}"
        when = (
            f"{self.seconds:.1f} s, cached"
            if not self.cached
            else f"cached, {self.seconds:.1f} s when derived"
        )
        return f"derived from the model code ({what}; {when})"


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling entry of config.json (``rope_scaling``, or one layer type's ``rope_parameters``)."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class Architecture:
    """The config.json numbers the pre-flight and the memory model need."""

    name: str
    source: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    head_dim: int
    model_type: str = ""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    attention_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    first_k_dense_layers: int = 0
    final_logit_softcapping: float = 0.0
    sliding_window: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    vision: VisionTower | None = None
    traced: TracedTerms | None = field(default=None, compare=False, repr=False)
    """Terms derived from a trace of the model's own code (None: a calibrated family, or not derived yet)."""
    config_json: str = field(default="", compare=False, repr=False)
    """The config.json mapping as read (canonical JSON), from which the model's code can be built."""
    config_type: str = ""
    """The config.json's own model_type (a vision-language model's, where ``model_type`` is its text model's)."""
    length_keys: tuple[tuple[str, int], ...] = ()
    """Every key of the text config that states a maximum length (``max_position_embeddings``, ``seq_length``...)."""
    rope_scaling: tuple[RopeScaling, ...] = ()

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): keys and values pass through a compressed latent."""
        return self.kv_lora_rank > 0

    @property
    def q_width(self) -> int:
        """Width of the queries of all heads (MLA: no-position plus rotary part per head)."""
        if self.mla:
            return self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys of all KV heads (MLA: every head's key, expanded from the latent)."""
        if self.mla:
            return self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_key_value_heads * self.head_dim

    @property
    def expert_intermediate_size(self) -> int:
        """Intermediate size of one routed expert (Mixtral's experts use ``intermediate_size``)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_layers(self) -> int:
        """Decoder layers whose MLP is a mixture of experts (0 for a dense model)."""
        return max(0, self.num_hidden_layers - self.first_k_dense_layers) if self.num_experts else 0

    @property
    def active_intermediate_size(self) -> int:
        """MLP width one token passes through in an MoE layer: its routed experts plus the shared ones."""
        routed = self.expert_intermediate_size * max(1, self.num_experts_per_tok)
        return routed + self.shared_expert_intermediate_size

    def _mla_params(self) -> int:
        h, a, rank = self.hidden_size, self.num_attention_heads, self.q_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * rank + rank + rank * a * qk if rank else h * a * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + a * self.v_head_dim * h

    def _attention_params(self) -> int:
        if self.mla:
            return self._mla_params()
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias or self.model_type.startswith("qwen2"):
            attn += q + 2 * kv
        if self.model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"):
            attn += 2 * self.head_dim
        return attn

    def _moe_mlp_params(self) -> int:
        h, e = self.hidden_size, self.num_experts
        routed = e * 3 * h * self.expert_intermediate_size + h * e
        return routed + 3 * h * self.shared_expert_intermediate_size + h * int(self.shared_expert_gate)

    @property
    def params(self) -> int:
        """Parameter count: counted on the model built from its code when traced, else from the shapes (MoE
        experts counted in full, first-k dense layers dense, a tied head once)."""
        if self.traced is not None:
            return self.traced.params
        h, v = self.hidden_size, self.vocab_size
        norms = 4 * h if self.model_type.startswith("gemma") and self.model_type != "gemma" else 2 * h
        dense = self.num_hidden_layers - self.moe_layers
        layers = (
            self.num_hidden_layers * (self._attention_params() + norms)
            + dense * 3 * h * self.intermediate_size
        )
        layers += self.moe_layers * self._moe_mlp_params()
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return layers + embed + h + (self.vision.params if self.vision else 0)


@dataclass(frozen=True)
class HardwareFacts:
    """What the pre-flight knows about the machines (None where unknown)."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu_memory_gb: float | None = None
    gpu_name: str | None = None
    flash_attn: bool | None = None
    host_memory_gb: float | None = None
    host_memory_from: str | None = None
    """Where the host memory figure came from (``hardware.host_memory_gb``, a job script's ``--mem`` line...)."""
    on_this_machine: bool = False
    """The GPUs were detected here (nvidia-smi, a Slurm allocation), so the run happens on this machine."""
    cpus_per_node: int | None = None
    """The logical CPUs a Ray started on a node counts (declared, or counted on this machine as Ray does)."""
    cpus_from: str | None = None
    cpus_certain: bool = False
    """The CPU count is the run's own: declared, or counted where verl itself runs (not a login node)."""
    ray_joins: str | None = None
    """Why ``ray.init()`` would join a running Ray rather than start one here (None: it starts one)."""
    ray_by: str | None = None
    """The verl-safe-launch verb that starts or joins Ray itself, with its own CPU count (None: verl does)."""


@dataclass(frozen=True)
class RuleContext:
    """Everything a rule may read: the config view, the model architectures (if known) and the hardware."""

    view: ConfigView
    actor_arch: Architecture | None = None
    critic_arch: Architecture | None = None
    hardware: HardwareFacts = field(default_factory=HardwareFacts)

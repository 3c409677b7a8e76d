"""What every stage after composition reads: the config view, the model architectures and the hardware."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_safe_launch.config_view import ConfigView


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

    def _attention_params(self) -> int:
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias or self.model_type == "qwen2":
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
        """Parameter count from the shapes (MoE experts counted in full, first-k dense layers dense)."""
        h, v = self.hidden_size, self.vocab_size
        norms = 4 * h if self.model_type.startswith("gemma") and self.model_type != "gemma" else 2 * h
        dense = self.num_hidden_layers - self.moe_layers
        layers = (
            self.num_hidden_layers * (self._attention_params() + norms)
            + dense * 3 * h * self.intermediate_size
        )
        layers += self.moe_layers * self._moe_mlp_params()
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return layers + embed + h


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

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

    @property
    def params(self) -> int:
        """Parameter count from the shapes (dense decoder; MoE experts counted in full)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias or self.model_type == "qwen2":
            attn += q + 2 * kv
        if self.model_type == "qwen3":
            attn += 2 * self.head_dim
        mlp = 3 * h * f
        if self.num_experts:
            mlp = self.num_experts * 3 * h * (self.moe_intermediate_size or f) + h * self.num_experts
        layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h


@dataclass(frozen=True)
class HardwareFacts:
    """What the pre-flight knows about the machines (None where unknown)."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu_memory_gb: float | None = None
    gpu_name: str | None = None


@dataclass(frozen=True)
class RuleContext:
    """Everything a rule may read: the config view, the model architectures (if known) and the hardware."""

    view: ConfigView
    actor_arch: Architecture | None = None
    critic_arch: Architecture | None = None
    hardware: HardwareFacts = field(default_factory=HardwareFacts)

"""The worker stages the memory hooks wrap: method, stage name, settings in force and the knobs they drive."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from verl_safe_launch.config_view import ARR


@dataclass(frozen=True)
class Setting:
    """One setting in force during a stage: the verl key that sets it and where the worker holds it."""

    key: str
    path: str


@dataclass(frozen=True)
class StageSpec:
    """One wrapped worker method: its stage, the settings in force and the knobs that drive its memory."""

    cls: str
    method: str
    stage: str
    settings: tuple[Setting, ...]
    micro: tuple[str, ...]
    budget: tuple[str, ...] = ()
    dynamic: str | None = None

    def knobs(self, values: Mapping[str, object]) -> tuple[str, ...]:
        """The keys that drive this stage's peak: token budgets under dynamic batching, else micro batches."""
        if self.dynamic is not None and values.get(self.dynamic):
            return self.budget
        return self.micro


def _batched(
    cls: str, method: str, stage: str, owner: str, keys: tuple[str, str, str], infer: bool
) -> StageSpec:
    """A stage driven by a TrainingWorker engine config: (dynamic switch, micro batch, token budget) keys."""
    dynamic, micro, budget = keys
    prefix = f"{owner}.engine_config" if owner else "engine_config"
    micro_field = "infer_micro_batch_size_per_gpu" if infer else "micro_batch_size_per_gpu"
    budget_field = "infer_max_token_len_per_gpu" if infer else "max_token_len_per_gpu"
    settings = (
        Setting(dynamic, f"{prefix}.use_dynamic_bsz"),
        Setting(micro, f"{prefix}.{micro_field}"),
        Setting(budget, f"{prefix}.{budget_field}"),
    )
    return StageSpec(cls, method, stage, settings, (micro,), (budget,), dynamic)


def _keys(prefix: str, names: tuple[str, str, str]) -> tuple[str, str, str]:
    return (prefix + names[0], prefix + names[1], prefix + names[2])


_OFFLOAD = (f"{ARR}.actor.fsdp_config.param_offload", f"{ARR}.actor.fsdp_config.optimizer_offload")
_GPU_UTIL = f"{ARR}.rollout.gpu_memory_utilization"
_CRITIC_BUDGET = "critic.ppo_infer_max_token_len_per_gpu"

STAGES: tuple[StageSpec, ...] = (
    StageSpec(
        "ActorRolloutRefWorker",
        "init_model",
        "init_model",
        (
            Setting(_OFFLOAD[0], "config.actor.fsdp_config.param_offload"),
            Setting(_OFFLOAD[1], "config.actor.fsdp_config.optimizer_offload"),
            Setting(f"{ARR}.ref.fsdp_config.param_offload", "config.ref.fsdp_config.param_offload"),
            Setting(_GPU_UTIL, "config.rollout.gpu_memory_utilization"),
        ),
        _OFFLOAD,
    ),
    _batched(
        "ActorRolloutRefWorker",
        "compute_log_prob",
        "old_log_prob",
        "actor",
        _keys(
            f"{ARR}.rollout.log_prob_",
            ("use_dynamic_bsz", "micro_batch_size_per_gpu", "max_token_len_per_gpu"),
        ),
        infer=True,
    ),
    _batched(
        "ActorRolloutRefWorker",
        "compute_ref_log_prob",
        "ref_log_prob",
        "ref",
        _keys(
            f"{ARR}.ref.log_prob_", ("use_dynamic_bsz", "micro_batch_size_per_gpu", "max_token_len_per_gpu")
        ),
        infer=True,
    ),
    _batched(
        "ActorRolloutRefWorker",
        "update_actor",
        "actor_update",
        "actor",
        _keys(
            f"{ARR}.actor.", ("use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu")
        ),
        infer=False,
    ),
    StageSpec(
        "ActorRolloutRefWorker",
        "update_weights",
        "weight_sync",
        (Setting(_GPU_UTIL, "config.rollout.gpu_memory_utilization"),),
        (_GPU_UTIL,),
    ),
    _batched(
        "TrainingWorker",
        "train_batch",
        "critic_update",
        "",
        ("critic.use_dynamic_bsz", "critic.ppo_micro_batch_size_per_gpu", _CRITIC_BUDGET),
        infer=False,
    ),
    _batched(
        "TrainingWorker",
        "infer_batch",
        "critic_values",
        "",
        ("critic.use_dynamic_bsz", "critic.forward_micro_batch_size_per_gpu", _CRITIC_BUDGET),
        infer=True,
    ),
)
STAGE_BY_NAME = {spec.stage: spec for spec in STAGES}

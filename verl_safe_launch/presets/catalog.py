"""The presets: what each is meant for, their values, and which one ``auto`` picks for the hardware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_safe_launch.compose import preset_dir
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import GPU_KEYS, HardwareProfile, read_yaml
from verl_safe_launch.provenance import Layer
from verl_safe_launch.rules import ACTOR_MICRO, LOGPROB_MICRO, REF_MICRO, pos_int

AUTO = "auto"


ACTOR_SP = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"


REF_SP = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size"


GPU_UTIL = "actor_rollout_ref.rollout.gpu_memory_utilization"


MAX_MODEL_LEN = "actor_rollout_ref.rollout.max_model_len"


MICRO_KEYS = (ACTOR_MICRO, LOGPROB_MICRO, REF_MICRO)


CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"


USER_LAYERS = (Layer.FILE, Layer.SCRIPT, Layer.CLI)


@dataclass(frozen=True)
class PresetInfo:
    """What a preset is for: the hardware it was tuned on and the model sizes it suits."""

    name: str
    hardware: str
    models: str
    summary: str


PRESETS: dict[str, PresetInfo] = {
    "small": PresetInfo("small", "1-2 GPUs, one machine", "7B-13B", "short steps, TP 1, small micro batches"),
    "medium": PresetInfo("medium", "6-8 GPUs, one node", "13B-34B", "48 prompts x 12 samples, rollout TP 2"),
    "cluster": PresetInfo(
        "cluster", "several nodes x 8 GPUs", "70B+", "FSDP + Ulysses 4 (remove padding on), rollout TP 2"
    ),
    AUTO: PresetInfo(
        AUTO, "picked from the hardware", "-", "up to 2 GPUs: small; one node: medium; more: cluster"
    ),
}


def preset_values(name: str) -> list[tuple[str, Any, int]]:
    """``(key, value, line)`` of ``conf/preset/NAME.yaml`` in file order (``defaults``/``hydra`` left out)."""
    doc = read_yaml(preset_dir() / f"{name}.yaml", expand_dots=True)
    skipped = ("defaults", "hydra")
    return [(leaf.key, leaf.value, leaf.line) for leaf in doc.leaves if leaf.key.split(".")[0] not in skipped]


def choose_auto(
    profile: HardwareProfile, view: ConfigView | None, where: str | None = None
) -> tuple[str, str]:
    """The preset ``auto`` stands for, and why: up to 2 GPUs small, one node medium, several nodes cluster."""
    counts = auto_counts(profile, view)
    if counts is None:
        raise UsageError(
            "preset=auto cannot pick a preset: the number of GPUs is unknown",
            where=where,
            fix="declare the hardware, e.g. hardware.gpus_per_node=8 hardware.nodes=1, or run inside the "
            "Slurm allocation or on the GPU machine",
        )
    gpus, nodes, why = counts
    name = "cluster" if nodes > 1 else "small" if gpus * nodes <= 2 else "medium"
    plural = "s" if nodes > 1 else ""
    return name, f"{gpus * nodes} GPUs on {nodes} node{plural}; {why}"


def auto_counts(profile: HardwareProfile, view: ConfigView | None) -> tuple[int, int, str] | None:
    if profile.gpus_per_node is not None:
        nodes = profile.nodes.value if profile.nodes else 1
        return profile.gpus_per_node.value, nodes, profile.gpus_per_node.source.reason or "hardware"
    if view is None:
        return None
    gpus, user_nodes = (_user_int(view, key) for key, _, _ in GPU_KEYS)
    if gpus is None:
        return None
    prov = view.prov(GPU_KEYS[0][0])
    return (
        gpus,
        user_nodes or 1,
        f"trainer.n_gpus_per_node from {prov.source.describe() if prov else 'the config'}",
    )


def _user_int(view: ConfigView, key: str) -> int | None:
    prov = view.prov(key)
    if prov is None or prov.source.layer not in USER_LAYERS:
        return None
    return pos_int(prov.value)

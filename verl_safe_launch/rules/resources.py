"""What a config asks Ray for: GPUs per pool and the CPUs verl reserves (one computation for rules and launch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.rules.plan import TRAINER_MODE, uses_v1

# verl's ResourcePoolManager places one bundle {"CPU": max_colocate_count=3, "GPU": 1} per GPU.
CPUS_PER_GPU = 3
# TransferQueue (V1 trainer) starts a controller plus one actor per storage unit, each holding one CPU;
# with fewer CPUs ``tq.init`` waits forever without a word.
TQ_CONTROLLER_CPUS = 1
# Actors with default resources (the task runner, agent-loop workers) need one free CPU to be placed.
SCHEDULING_HEADROOM = 1


@dataclass(frozen=True)
class GpuNeed:
    """GPUs the config asks Ray for: verl's global pool plus the standalone rollout, reward and teacher pools."""

    global_pool: int
    reward_pool: int = 0
    teacher_pool: int = 0
    parts: tuple[str, ...] = field(default=())
    rollout_pool: int = 0

    @property
    def total(self) -> int:
        """All pools together."""
        return self.global_pool + self.rollout_pool + self.reward_pool + self.teacher_pool

    def describe(self) -> str:
        """``6 (global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1)``."""
        return f"{self.total} ({' + '.join(self.parts)})"


@dataclass(frozen=True)
class CpuNeed:
    """Ray CPUs the trainer reserves: GPU bundles, TransferQueue actors and scheduling headroom."""

    gpu_bundles: int
    transfer_queue: int
    headroom: int = SCHEDULING_HEADROOM

    @property
    def total(self) -> int:
        """All reservations together."""
        return self.gpu_bundles + self.transfer_queue + self.headroom

    def describe(self) -> str:
        """``28 (GPU bundles 18 + TransferQueue 9 + scheduling 1)``."""
        return (
            f"{self.total} (GPU bundles {self.gpu_bundles} + TransferQueue {self.transfer_queue}"
            f" + scheduling {self.headroom})"
        )


def _int(view: ConfigView, key: str) -> int:
    value = view.get(key)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _pool(view: ConfigView, prefix: str, label: str) -> tuple[int, str]:
    gpus, nodes = _int(view, f"{prefix}.n_gpus_per_node"), _int(view, f"{prefix}.nnodes")
    return gpus * nodes, f"{label} {gpus * nodes} = {prefix}.n_gpus_per_node {gpus} × nnodes {nodes}"


def gpu_need(view: ConfigView) -> GpuNeed:
    """GPUs per pool exactly as verl's trainer builds its resource pool spec."""
    per_node, nodes = _int(view, "trainer.n_gpus_per_node"), _int(view, "trainer.nnodes")
    parts = [f"global pool {per_node * nodes} = trainer.n_gpus_per_node {per_node} × trainer.nnodes {nodes}"]
    rollout = reward = teacher = 0
    if uses_v1(view) and view.get(TRAINER_MODE) == "separate_async":
        rollout, text = _pool(view, f"{ARR}.rollout", "rollout pool")
        parts.append(text)
    if view.get("reward.reward_model.enable_resource_pool"):
        reward, text = _pool(view, "reward.reward_model", "reward pool")
        parts.append(text)
    if view.get("distillation.enabled"):
        teacher, text = _pool(view, "distillation", "teacher pool")
        parts.append(text)
    return GpuNeed(per_node * nodes, reward, teacher, tuple(parts), rollout)


def cpu_need(view: ConfigView, gpus: GpuNeed | None = None) -> CpuNeed:
    """Ray CPUs the run reserves; the TransferQueue share applies to the V1 trainer (or TQ enabled)."""
    gpus = gpus or gpu_need(view)
    tq = 0
    if uses_v1(view) or view.get("transfer_queue.enable"):
        units = _int(view, "transfer_queue.backend.SimpleStorage.num_data_storage_units") or 1
        tq = TQ_CONTROLLER_CPUS + units
    return CpuNeed(CPUS_PER_GPU * gpus.total, tq)

"""The hardware profile: what is known about the machines, each value with where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from verl_safe_launch.context import HardwareFacts
from verl_safe_launch.provenance import Source

T = TypeVar("T", bool, int, float, str)


@dataclass(frozen=True)
class Fact(Generic[T]):
    """One hardware value and where it came from."""

    value: T
    source: Source


@dataclass(frozen=True)
class GpuRow:
    """One line of ``nvidia-smi``: the GPU's index, name and memory in MiB."""

    index: int
    name: str
    memory_mib: float


@dataclass(frozen=True)
class HardwareProfile:
    """What is known about the machines, each value with its source, plus detection notes (warnings)."""

    nodes: Fact[int] | None = None
    gpus_per_node: Fact[int] | None = None
    gpu_memory_gb: Fact[float] | None = None
    gpu_name: Fact[str] | None = None
    notes: tuple[str, ...] = ()
    flash_attn: Fact[bool] | None = None
    host_memory_gb: Fact[float] | None = None
    cpus_per_node: Fact[int] | None = None
    ray_joins: str | None = None
    in_entry_point: bool = False
    """The profile is read inside verl's own entry point, on the machine where it starts Ray."""
    allocation_for: str | None = None
    """The verb whose job asks for exactly this hardware (``slurm``, ``kuberay``): the config must use all of it."""
    ray_by: str | None = None
    """The verb that starts or joins Ray itself, with its own CPU count (``verl-safe-launch run``)."""

    def facts(self) -> HardwareFacts:
        """The plain values the rules read (None where unknown)."""
        return HardwareFacts(
            nodes=self.nodes.value if self.nodes else None,
            gpus_per_node=self.gpus_per_node.value if self.gpus_per_node else None,
            gpu_memory_gb=self.gpu_memory_gb.value if self.gpu_memory_gb else None,
            gpu_name=self.gpu_name.value if self.gpu_name else None,
            flash_attn=self.flash_attn.value if self.flash_attn else None,
            host_memory_gb=self.host_memory_gb.value if self.host_memory_gb else None,
            host_memory_from=self.host_memory_gb.source.describe() if self.host_memory_gb else None,
            on_this_machine=self.detected_here,
            cpus_per_node=self.cpus_per_node.value if self.cpus_per_node else None,
            cpus_from=self.cpus_per_node.source.describe() if self.cpus_per_node else None,
            cpus_certain=self._cpus_certain,
            ray_joins=self.ray_joins,
            ray_by=self.ray_by,
        )

    @property
    def _cpus_certain(self) -> bool:
        fact = self.cpus_per_node
        declared = fact is not None and (fact.source.reason or "").startswith("declared")
        return declared or self.in_entry_point or self.detected_here

    @property
    def detected_here(self) -> bool:
        """True when the GPU count was detected on this machine rather than declared or read from a file."""
        fact = self.gpus_per_node
        if fact is None or fact.source.file is not None:
            return False
        return not (fact.source.reason or "").startswith(("declared", "given"))


def merge_profiles(first: HardwareProfile, then: HardwareProfile) -> HardwareProfile:
    """Each value from ``first`` where it knows it, else from ``then`` (notes from both)."""
    return HardwareProfile(
        nodes=first.nodes or then.nodes,
        gpus_per_node=first.gpus_per_node or then.gpus_per_node,
        gpu_memory_gb=first.gpu_memory_gb or then.gpu_memory_gb,
        gpu_name=first.gpu_name or then.gpu_name,
        notes=first.notes + then.notes,
        flash_attn=first.flash_attn or then.flash_attn,
        host_memory_gb=first.host_memory_gb or then.host_memory_gb,
        cpus_per_node=first.cpus_per_node or then.cpus_per_node,
        ray_joins=first.ray_joins or then.ray_joins,
        in_entry_point=first.in_entry_point or then.in_entry_point,
        allocation_for=first.allocation_for or then.allocation_for,
        ray_by=first.ray_by or then.ray_by,
    )

"""The pre-flight of a Slurm job for a declared allocation: what ``slurm`` checks before it writes a job."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from verl_safe_launch.backends.bringup import cpus_per_task
from verl_safe_launch.compose import Composed
from verl_safe_launch.findings import Finding
from verl_safe_launch.inputs import (
    DETECT_ENV,
    ComposeRequest,
    HardwareProfile,
    OverrideToken,
    detect_hardware,
    hardware_fills,
    split_tool_tokens,
)
from verl_safe_launch.preflight import launch_preflight
from verl_safe_launch.presets import compose_with_preset


def compose_allocation(
    base: ComposeRequest, hardware: Sequence[OverrideToken], verb: str
) -> tuple[Composed, HardwareProfile]:
    """Compose for the declared allocation only (``hardware`` holds its ``hardware.*`` tokens): nothing is
    read from the machine this runs on. The config must use all of it (the job ``verb`` writes asks for exactly
    that)."""
    tokens = base.overrides + tuple(hardware)
    profile = replace(
        detect_hardware(split_tool_tokens(tokens)[1], env={DETECT_ENV: "0"}), allocation_for=verb
    )
    request = replace(base, overrides=tokens, fills=hardware_fills(profile))
    return compose_with_preset(request, profile), profile


def allocation_findings(
    composed: Composed, profile: HardwareProfile, cpus_given: int | None, nodes: int
) -> tuple[list[Finding], int]:
    """The pre-flight of a job on ``nodes`` nodes of the allocation, with its ``--cpus-per-task`` check; and
    the CPUs per task the job asks for."""
    pre = launch_preflight(composed, "slurm", profile)
    cpus, cpu_finding = cpus_per_task(composed.view, cpus_given, nodes)
    return [*pre.findings, *([cpu_finding] if cpu_finding else [])], cpus


__all__ = ["allocation_findings", "compose_allocation"]

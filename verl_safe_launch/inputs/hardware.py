"""Detect the hardware (explicit ``hardware.*`` tokens, then a Slurm allocation, then ``nvidia-smi``) and use it:
the GPU counts composition fills, the contradictions the pre-flight reports."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import HardwareFacts
from verl_safe_launch.errors import UsageError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs.cpus import existing_ray
from verl_safe_launch.inputs.machine import (
    counted_cpus,
    flash_attn_installed,
    from_nvidia_smi,
    from_slurm,
    meminfo,
    slurm_memory,
    within_devices,
)
from verl_safe_launch.inputs.overrides import ToolSettings
from verl_safe_launch.inputs.profile import Fact, HardwareProfile, T
from verl_safe_launch.provenance import Layer, Source, Write

DETECT_ENV = "VSL_HARDWARE_DETECT"
"""Set to 0 to ignore the environment (Slurm, CUDA_VISIBLE_DEVICES, nvidia-smi); tokens still count."""


def detect_hardware(tool: ToolSettings, env: Mapping[str, str] | None = None) -> HardwareProfile:
    """Build the profile: each value from the most trusted place that knows it (tokens, Slurm, nvidia-smi)."""
    env = os.environ if env is None else env
    declared = _from_tokens(tool)
    if env.get(DETECT_ENV, "1") == "0":
        return declared
    notes: list[str] = []
    slurm = from_slurm(env, notes)
    smi = from_nvidia_smi(env)
    return HardwareProfile(
        nodes=declared.nodes or slurm.nodes,
        gpus_per_node=declared.gpus_per_node or within_devices(slurm.gpus_per_node, smi.gpus_per_node),
        gpu_memory_gb=declared.gpu_memory_gb or smi.gpu_memory_gb,
        gpu_name=declared.gpu_name or smi.gpu_name or slurm.gpu_name,
        notes=tuple(notes) + smi.notes,
        flash_attn=declared.flash_attn
        or flash_attn_installed(env, bool(smi.gpus_per_node or slurm.gpus_per_node)),
        host_memory_gb=declared.host_memory_gb
        or slurm_memory(env)
        or (meminfo() if smi.gpus_per_node else None),
        cpus_per_node=declared.cpus_per_node or counted_cpus(env),
        ray_joins=existing_ray(env),
    )


def as_profile(tool: ToolSettings, hardware: HardwareFacts | HardwareProfile | None) -> HardwareProfile:
    """A profile from what a caller passed: nothing (detect), plain facts (taken as given) or a profile."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware is None:
        return detect_hardware(tool)
    given = Source(Layer.HARDWARE, reason="given to the pre-flight")

    def fact(value: T | None) -> Fact[T] | None:
        return Fact(value, given) if value is not None else None

    return HardwareProfile(
        fact(hardware.nodes),
        fact(hardware.gpus_per_node),
        fact(hardware.gpu_memory_gb),
        fact(hardware.gpu_name),
        flash_attn=fact(hardware.flash_attn),
        host_memory_gb=fact(hardware.host_memory_gb),
        cpus_per_node=fact(hardware.cpus_per_node),
        ray_joins=hardware.ray_joins,
        ray_by=hardware.ray_by,
    )


# --- explicit tokens -------------------------------------------------------------------------------------


def _from_tokens(tool: ToolSettings) -> HardwareProfile:
    hw = tool.hardware
    return HardwareProfile(
        nodes=_token(hw, "nodes", _positive_int, "a whole number from 1 to 100000", "hardware.nodes=2"),
        gpus_per_node=_token(
            hw, "gpus_per_node", _positive_int, "a whole number from 1 to 100000", "hardware.gpus_per_node=8"
        ),
        gpu_memory_gb=_token(
            hw,
            "gpu_memory_gb",
            _positive_float,
            "a number of GB above 0 and at most 10000",
            "hardware.gpu_memory_gb=80",
        ),
        gpu_name=_token(hw, "gpu_name", _non_empty, "a non-empty name", "hardware.gpu_name=H100"),
        flash_attn=_token(hw, "flash_attn", _boolean, "true or false", "hardware.flash_attn=false"),
        host_memory_gb=_token(
            hw, "host_memory_gb", _positive_float, "a positive number of GB", "hardware.host_memory_gb=512"
        ),
        cpus_per_node=_token(
            hw, "cpus_per_node", _positive_int, "a whole number from 1 to 100000", "hardware.cpus_per_node=64"
        ),
    )


def _token(
    hw: Mapping[str, tuple[str, Source]],
    name: str,
    convert: Callable[[str], T | None],
    wanted: str,
    example: str,
) -> Fact[T] | None:
    if name not in hw:
        return None
    text, source = hw[name]
    value = convert(text.strip())
    if value is None:
        raise UsageError(
            f"hardware.{name}={text} is not {wanted}",
            where=source.describe(),
            fix=f"pass e.g. {example}",
        )
    return Fact(value, Source(Layer.HARDWARE, reason=f"declared on the {source.describe()}"))


MAX_COUNT = 100_000
"""The largest node or GPU count taken (a larger one is a typo, and would only overflow the arithmetic)."""
MAX_GPU_MEMORY_GB = 10_000.0


def _positive_int(text: str) -> int | None:
    if not text.isascii() or not text.isdigit() or len(text) > 6:
        return None
    return int(text) if 0 < int(text) <= MAX_COUNT else None


def _positive_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= MAX_GPU_MEMORY_GB else None


def _non_empty(text: str) -> str | None:
    return text or None


def _boolean(text: str) -> bool | None:
    return {"true": True, "false": False}.get(text.lower())


# --- use in composition and in the pre-flight -----------------------------------------------------------

GPU_KEYS = (
    ("trainer.n_gpus_per_node", "gpus_per_node", "GPUs per node"),
    ("trainer.nnodes", "nodes", "nodes"),
)


def count_of(count: int, noun: str) -> str:
    """``1 GPU per node``, ``6 GPUs per node``, ``1 node``, ``2 nodes``."""
    if count != 1:
        return f"{count} {noun}"
    head, _, rest = noun.partition(" ")
    return f"1 {head.removesuffix('s')}" + (f" {rest}" if rest else "")


def hardware_fills(profile: HardwareProfile) -> tuple[Write, ...]:
    """Writes for ``trainer.n_gpus_per_node`` / ``trainer.nnodes`` (composition applies them where unset)."""
    fills: list[Write] = []
    for key, name, _ in GPU_KEYS:
        fact: Fact[int] | None = getattr(profile, name)
        if fact is not None:
            fills.append(Write(key, fact.value, fact.source))
    return tuple(fills)


def hardware_findings(view: ConfigView, profile: HardwareProfile) -> list[Finding]:
    """Mismatches between the config's GPU counts and the hardware, detection notes, and what is unknown."""
    findings = [f for key, name, noun in GPU_KEYS if (f := _mismatch(view, profile, key, name, noun))]
    findings += [Finding("hardware-detect", Severity.WARNING, (), note) for note in profile.notes]
    unknown = _unknown(profile)
    if unknown:
        findings.append(unknown)
    return findings


def _mismatch(view: ConfigView, profile: HardwareProfile, key: str, name: str, noun: str) -> Finding | None:
    fact: Fact[int] | None = getattr(profile, name)
    value = view.get(key)
    prov = view.prov(key)
    if fact is None or prov is None or isinstance(value, bool) or not isinstance(value, int):
        return None
    if value == fact.value or prov.source.layer is Layer.HARDWARE:
        return None
    sources = ((key, value, prov.source), (f"hardware.{name}", fact.value, fact.source))
    if value > fact.value:
        return Finding(
            "hardware-mismatch",
            Severity.ERROR,
            (key,),
            f"{key}={value} asks for more {noun} than the hardware has ({fact.value})"
            + _lines(prov.source, fact),
            f"{key}={fact.value}" + _UNSET_HINT.get(prov.source.layer, _UNSET_HINT[Layer.CLI]),
            sources,
        )
    if profile.allocation_for is not None:
        return _idle_in_job(key, value, fact, noun, profile.allocation_for, sources)
    return Finding(
        "hardware-mismatch",
        Severity.WARNING,
        (key,),
        f"{key}={value} uses fewer {noun} than the hardware has ({fact.value}); the rest stay idle"
        + _lines(prov.source, fact),
        f"{key}={fact.value}, or declare hardware.{name}={value} if leaving them idle is intended",
        sources,
    )


_JOB_FLAGS = {"nodes": "--nodes", "GPUs per node": "--gpus-per-node"}


def _idle_in_job(
    key: str, value: int, fact: Fact[int], noun: str, verb: str, sources: tuple[tuple[str, Any, Source], ...]
) -> Finding:
    """A generated job asks for the allocation and must use all of it: fewer is an error, not idle hardware."""
    flag = _JOB_FLAGS.get(noun, f"hardware.{noun}")
    return Finding(
        "hardware-mismatch",
        Severity.ERROR,
        (key,),
        f"{key}={value} uses fewer {noun} than the {verb} job asks for ({fact.value}): the job would hold "
        f"{fact.value} and leave {fact.value - value} of them idle",
        f"{key}={fact.value}; or {flag} {value}",
        sources,
    )


def _lines(config: Source, fact: Fact[int]) -> str:
    """`` (line 70 of job.sbatch; the allocation: #SBATCH --nodes=2, line 3)`` when the fact cites a line."""
    hw = fact.source
    if hw.line is None or hw.file is None:
        return ""
    where = (
        f"line {config.line} of {config.file}"
        if config.line is not None and config.file
        else config.describe()
    )
    return f" ({where}; the allocation: {hw.reason or hw.raw}, line {hw.line})"


_UNSET_HINT = {
    Layer.VERL: " (verl's default does not match the hardware)",
    Layer.PRESET: " (a preset's static value: verl-safe-launch's own commands adapt it to the hardware)",
    Layer.CLI: " (or leave it unset: verl-safe-launch fills it from the hardware)",
}
_UNKNOWN = (("gpus_per_node", "GPUs per node", "8"), ("gpu_memory_gb", "GPU memory", "80"))


def _unknown(profile: HardwareProfile) -> Finding | None:
    missing = [(name, title, example) for name, title, example in _UNKNOWN if getattr(profile, name) is None]
    if not missing:
        return None
    what = " and ".join(title for _, title, _ in missing)
    return Finding(
        "hardware-unknown",
        Severity.INFO,
        (),
        f"{what} unknown (not declared, no Slurm allocation or nvidia-smi detected): GPU counts come "
        "from the config and memory verdicts say 'unknown'",
        "declare the hardware, e.g. "
        + " ".join(f"hardware.{name}={example}" for name, _, example in missing),
    )

"""The hardware profile: explicit ``hardware.*`` tokens, then a Slurm allocation, then ``nvidia-smi``."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import HardwareFacts
from verl_safe_launch.errors import UsageError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs.cpus import existing_ray, ray_cpu_count
from verl_safe_launch.inputs.overrides import ToolSettings
from verl_safe_launch.inputs.visible import invalid_note, visible_entries
from verl_safe_launch.provenance import Layer, Source, Write

T = TypeVar("T", bool, int, float, str)

DETECT_ENV = "VSL_HARDWARE_DETECT"
"""Set to 0 to ignore the environment (Slurm, CUDA_VISIBLE_DEVICES, nvidia-smi); tokens still count."""

NVIDIA_SMI_QUERY = ("--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
_NO_DEVICES = ("", "-1", "NoDevFiles")


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


def detect_hardware(tool: ToolSettings, env: Mapping[str, str] | None = None) -> HardwareProfile:
    """Build the profile: each value from the most trusted place that knows it (tokens, Slurm, nvidia-smi)."""
    env = os.environ if env is None else env
    declared = _from_tokens(tool)
    if env.get(DETECT_ENV, "1") == "0":
        return declared
    notes: list[str] = []
    slurm = _from_slurm(env, notes)
    smi = _from_nvidia_smi(env)
    return HardwareProfile(
        nodes=declared.nodes or slurm.nodes,
        gpus_per_node=declared.gpus_per_node or _within_devices(slurm.gpus_per_node, smi.gpus_per_node),
        gpu_memory_gb=declared.gpu_memory_gb or smi.gpu_memory_gb,
        gpu_name=declared.gpu_name or smi.gpu_name or slurm.gpu_name,
        notes=tuple(notes) + smi.notes,
        flash_attn=declared.flash_attn or _flash_attn_installed(env),
        host_memory_gb=declared.host_memory_gb
        or _slurm_memory(env)
        or (_meminfo() if smi.gpus_per_node else None),
        cpus_per_node=declared.cpus_per_node or _counted_cpus(env),
        ray_joins=existing_ray(env),
    )


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
        ray_by=first.ray_by or then.ray_by,
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


def _counted_cpus(env: Mapping[str, str]) -> Fact[int]:
    count, how = ray_cpu_count(env)
    return Fact(count, Source(Layer.HARDWARE, reason=f"detected: {how}, as Ray counts it"))


# --- the software and host memory of this machine --------------------------------------------------------


FLASH_CE_OFF = "VERL_DISABLE_FLASH_ATTN_CE"


def _flash_attn_installed(env: Mapping[str, str]) -> Fact[bool]:
    """Whether verl will use flash-attn's cross-entropy: importable here and not switched off."""
    import importlib.util

    if env.get(FLASH_CE_OFF) == "1":
        return Fact(False, Source(Layer.HARDWARE, reason=f"detected: {FLASH_CE_OFF}=1 in the environment"))
    found = importlib.util.find_spec("flash_attn") is not None
    what = "importable" if found else "not importable"
    return Fact(found, Source(Layer.HARDWARE, reason=f"detected: flash_attn is {what} in this Python"))


_SLURM_MEM = re.compile(r"^(\d+)([KMGT]?)$")
_MEM_UNIT_GIB = {"K": 1 / (1 << 20), "M": 1 / 1024, "": 1 / 1024, "G": 1.0, "T": 1024.0}


def slurm_mem_gib(text: str) -> float | None:
    """GiB of a Slurm memory size (``--mem`` / ``SLURM_MEM_PER_NODE``: MiB unless suffixed K, M, G or T)."""
    match = _SLURM_MEM.match(text.strip().upper())
    if not match or int(match.group(1)) == 0:
        return None
    return round(int(match.group(1)) * _MEM_UNIT_GIB[match.group(2)], 1)


def _slurm_memory(env: Mapping[str, str]) -> Fact[float] | None:
    """Host memory of the job on one node from ``SLURM_MEM_PER_NODE`` (``--mem``; MiB unless suffixed)."""
    text = env.get("SLURM_MEM_PER_NODE", "").strip().upper()
    gib = slurm_mem_gib(text)
    if gib is None:
        return None
    return Fact(gib, Source(Layer.HARDWARE, reason=f"detected: SLURM_MEM_PER_NODE={text} (sbatch --mem)"))


def _meminfo(path: str = "/proc/meminfo") -> Fact[float] | None:
    """Host memory of this machine from ``/proc/meminfo`` (MemTotal, KiB); read only where nvidia-smi found GPUs,
    so that a login node's memory is not taken for the training nodes'."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        return None
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.M)
    if not match:
        return None
    gib = round(int(match.group(1)) / (1 << 20), 1)
    return Fact(gib, Source(Layer.HARDWARE, reason=f"detected: {path} MemTotal"))


# --- Slurm allocation and visible devices ----------------------------------------------------------------


def _from_slurm(env: Mapping[str, str], notes: list[str]) -> HardwareProfile:
    nodes = _env_count(env, ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), "Slurm allocation", notes)
    gpus = _env_count(env, ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"), "Slurm allocation", notes)
    gpus = gpus or _list_count(env, "SLURM_JOB_GPUS", "Slurm allocation", notes)
    visible = _list_count(env, "CUDA_VISIBLE_DEVICES", "visible GPUs", notes)
    if gpus and visible and visible.value != gpus.value:
        notes.append(
            f"CUDA_VISIBLE_DEVICES shows {visible.value} GPUs but {gpus.source.reason} says "
            f"{gpus.value}; planning for {gpus.value}"
        )
    return HardwareProfile(nodes=nodes, gpus_per_node=gpus or visible, gpu_name=_slurm_gpu_type(env))


def _within_devices(visible: Fact[int] | None, devices: Fact[int] | None) -> Fact[int] | None:
    """The visible count, but never more than the devices nvidia-smi lists through CUDA_VISIBLE_DEVICES
    (an index past the last device ends CUDA's list)."""
    if visible is None or devices is None:
        return visible or devices
    if "CUDA_VISIBLE_DEVICES" not in (visible.source.reason or "") or devices.value >= visible.value:
        return visible
    reason = (
        f"{visible.source.reason}, of which nvidia-smi lists {devices.value} before an index it does not have"
    )
    return Fact(devices.value, Source(Layer.HARDWARE, reason=reason))


def _env_count(
    env: Mapping[str, str], names: tuple[str, ...], what: str, notes: list[str]
) -> Fact[int] | None:
    for name in names:
        text = env.get(name, "").strip()
        if not text:
            continue
        match = re.fullmatch(r"(?:[\w-]+:)*(\d+)(?:\(.*\))?", text)
        if match and int(match.group(1)) > 0:
            return Fact(int(match.group(1)), Source(Layer.HARDWARE, reason=f"{what}, {name}={text}"))
        notes.append(f"ignored {name}={text}: not a GPU or node count")
    return None


def _list_count(env: Mapping[str, str], name: str, what: str, notes: list[str]) -> Fact[int] | None:
    if name not in env:
        return None
    text = env[name].strip()
    if text in _NO_DEVICES:
        notes.append(f"{name}={text!s} hides every GPU from this process")
        return None
    if name != "CUDA_VISIBLE_DEVICES":
        count = len([item for item in text.split(",") if item.strip()])
        return Fact(count, Source(Layer.HARDWARE, reason=f"{what}, {name}={text}"))
    kept, bad = visible_entries(text)
    if bad is not None:
        notes.append(invalid_note(name, text, kept, bad))
    if not kept:
        return None
    return Fact(len(kept), Source(Layer.HARDWARE, reason=f"{what}, {name}={text}"))


def _slurm_gpu_type(env: Mapping[str, str]) -> Fact[str] | None:
    text = env.get("SLURM_GPUS_PER_NODE", "")
    match = re.fullmatch(r"(?:gpu:)?([A-Za-z][\w-]*):\d+", text.strip())
    if not match:
        return None
    return Fact(
        match.group(1), Source(Layer.HARDWARE, reason=f"Slurm allocation, SLURM_GPUS_PER_NODE={text}")
    )


# --- nvidia-smi ------------------------------------------------------------------------------------------


def _from_nvidia_smi(env: Mapping[str, str]) -> HardwareProfile:
    search = env.get("PATH")
    exe = shutil.which("nvidia-smi", path=search) if search else None
    if exe is None:
        return HardwareProfile()
    rows, problem = _query_nvidia_smi(exe, os.stat(exe).st_mtime_ns)
    if problem:
        return HardwareProfile(notes=(problem,))
    rows = _visible_rows(rows, env.get("CUDA_VISIBLE_DEVICES"))
    if not rows:
        return HardwareProfile()
    return _profile_from_rows(rows)


@functools.lru_cache(maxsize=16)
def _query_nvidia_smi(exe: str, mtime_ns: int) -> tuple[tuple[GpuRow, ...], str | None]:
    try:
        done = subprocess.run(
            [exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (), f"nvidia-smi could not run: {exc}"
    if done.returncode != 0:
        first = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[
            0
        ]
        return (), f"nvidia-smi failed: {first}"
    try:
        return parse_nvidia_smi(done.stdout), None
    except ValueError as exc:
        return (), f"nvidia-smi printed something unexpected: {exc}"


def parse_nvidia_smi(text: str) -> tuple[GpuRow, ...]:
    """Parse ``name, memory.total`` CSV lines (MiB, no units); raise ValueError on a malformed line."""
    rows: list[GpuRow] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, memory = line.rpartition(",")
        if not sep or not name.strip():
            raise ValueError(f"'{line.strip()}'")
        rows.append(GpuRow(len(rows), name.strip(), float(memory)))
    return tuple(rows)


def _visible_rows(rows: tuple[GpuRow, ...], visible: str | None) -> tuple[GpuRow, ...]:
    if visible is None:
        return rows
    wanted, _ = visible_entries(visible)
    if not all(item.isdigit() for item in wanted):
        return rows
    by_index = {str(row.index): row for row in rows}
    picked: list[GpuRow] = []
    for item in wanted:  # an index past the last device ends the list too, as any invalid entry does
        if item not in by_index:
            break
        picked.append(by_index[item])
    return tuple(picked) or rows


def _profile_from_rows(rows: tuple[GpuRow, ...]) -> HardwareProfile:
    smallest = min(rows, key=lambda row: row.memory_mib)
    gib = round(smallest.memory_mib / 1024, 1)
    kinds = sorted({(row.name, row.memory_mib) for row in rows}, key=lambda kind: kind[1])
    described = ", ".join(f"{sum(1 for r in rows if (r.name, r.memory_mib) == k)} × {k[0]}" for k in kinds)
    source = Source(Layer.HARDWARE, reason=f"nvidia-smi, {described} ({gib:g} GiB each)")
    notes: tuple[str, ...] = ()
    if len(kinds) > 1:
        source = Source(Layer.HARDWARE, reason=f"nvidia-smi, {described}; the smallest has {gib:g} GiB")
        notes = (
            f"mixed GPU types on this machine ({described}): planning for the smallest, {smallest.name}",
        )
    return HardwareProfile(
        gpus_per_node=Fact(len(rows), source),
        gpu_memory_gb=Fact(gib, source),
        gpu_name=Fact(smallest.name, source),
        notes=notes,
    )


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
    return Finding(
        "hardware-mismatch",
        Severity.WARNING,
        (key,),
        f"{key}={value} uses fewer {noun} than the hardware has ({fact.value}); the rest stay idle"
        + _lines(prov.source, fact),
        f"{key}={fact.value}, or declare hardware.{name}={value} if leaving them idle is intended",
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

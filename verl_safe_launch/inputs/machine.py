"""Hardware read off the environment: a Slurm allocation, visible devices, ``nvidia-smi``, host memory, CPUs and
flash attention."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from verl_safe_launch.inputs.cpus import ray_cpu_count
from verl_safe_launch.inputs.profile import Fact, GpuRow, HardwareProfile
from verl_safe_launch.inputs.visible import invalid_note, visible_entries
from verl_safe_launch.provenance import Layer, Source

NVIDIA_SMI_QUERY = ("--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
_NO_DEVICES = ("", "-1", "NoDevFiles")


def counted_cpus(env: Mapping[str, str]) -> Fact[int]:
    count, how = ray_cpu_count(env)
    return Fact(count, Source(Layer.HARDWARE, reason=f"detected: {how}, as Ray counts it"))


# --- the software and host memory of this machine --------------------------------------------------------


FLASH_CE_OFF = "VERL_DISABLE_FLASH_ATTN_CE"


def flash_attn_installed(env: Mapping[str, str], gpus_here: bool) -> Fact[bool] | None:
    """Whether verl will use flash-attn's cross-entropy: switched off, or importable in this Python where the
    GPUs are (``gpus_here``); None where nothing here tells."""
    import importlib.util

    if env.get(FLASH_CE_OFF) == "1":
        return Fact(False, Source(Layer.HARDWARE, reason=f"detected: {FLASH_CE_OFF}=1 in the environment"))
    if not gpus_here:
        return None
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


def slurm_memory(env: Mapping[str, str]) -> Fact[float] | None:
    """Host memory of the job on one node from ``SLURM_MEM_PER_NODE`` (``--mem``; MiB unless suffixed)."""
    text = env.get("SLURM_MEM_PER_NODE", "").strip().upper()
    gib = slurm_mem_gib(text)
    if gib is None:
        return None
    return Fact(gib, Source(Layer.HARDWARE, reason=f"detected: SLURM_MEM_PER_NODE={text} (sbatch --mem)"))


def meminfo(path: str = "/proc/meminfo") -> Fact[float] | None:
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


def from_slurm(env: Mapping[str, str], notes: list[str]) -> HardwareProfile:
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


def within_devices(visible: Fact[int] | None, devices: Fact[int] | None) -> Fact[int] | None:
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


def from_nvidia_smi(env: Mapping[str, str]) -> HardwareProfile:
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

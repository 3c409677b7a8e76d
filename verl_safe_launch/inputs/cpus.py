"""The CPUs a Ray started on this machine counts, and whether ``ray.init()`` starts one here at all."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
"""Where the container's CPU limits live (cgroup v1 ``cpu/`` and ``cpuset/``, or v2 ``cpu.max``)."""


def ray_cpu_count(env: Mapping[str, str], cgroup: Path = CGROUP) -> tuple[int, str]:
    """The logical CPUs ``ray.init(num_cpus=None)`` gives this node, and how it was counted.

    Ray's own rule: a cgroup CPU quota or cpuset when one is set (the smaller of the two, at least 1),
    else the machine's CPU count; ``RAY_USE_MULTIPROCESSING_CPU_COUNT`` skips the cgroup.
    """
    total = os.cpu_count() or 1
    if env.get("RAY_USE_MULTIPROCESSING_CPU_COUNT"):
        return total, "this machine's CPU count (RAY_USE_MULTIPROCESSING_CPU_COUNT is set)"
    limits = [(n, why) for n, why in (_quota(cgroup), _cpuset(cgroup)) if n is not None]
    if not limits:
        return total, "this machine's CPU count"
    count, why = min(limits)
    return max(1, count), why


def _quota(cgroup: Path) -> tuple[int | None, str]:
    v1 = (cgroup / "cpu" / "cpu.cfs_quota_us", cgroup / "cpu" / "cpu.cfs_period_us")
    if v1[0].exists() and v1[1].exists():
        quota, period, name = _read(v1[0]), _read(v1[1]), "cpu.cfs_quota_us"
    else:
        parts = (_read(cgroup / "cpu.max") or "").split()
        quota, period, name = (parts[0], parts[1], "cpu.max") if len(parts) == 2 else (None, None, "")
    try:
        value = float(quota or "") / float(period or "")
    except (ValueError, ZeroDivisionError):
        return None, ""
    if value < 0:
        return None, ""
    return max(1, math.floor(value)), f"the container's CPU quota (cgroup {name})"


def _cpuset(cgroup: Path) -> tuple[int | None, str]:
    text = _read(cgroup / "cpuset" / "cpuset.cpus")
    if not text:
        return None, ""
    count = 0
    try:
        for part in text.split(","):
            start, _, end = part.partition("-")
            count += int(end or start) - int(start) + 1
    except ValueError:
        return None, ""
    return count, "the container's cpuset (cgroup cpuset.cpus)"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def existing_ray(env: Mapping[str, str], temp_dir: str | None = None) -> str | None:
    """Why ``ray.init()`` without an address would join a running Ray instead of starting one, or None.

    Ray's own rule (``services.get_ray_address_from_environment``): ``RAY_ADDRESS``, else the cluster that
    ``ray start`` recorded in ``ray_current_cluster`` under Ray's temp dir (``_temp_dir``, else ``RAY_TMPDIR``
    or ``TMPDIR`` or ``/tmp``, plus ``ray``). A Ray started by another ``ray.init()`` is not joined.
    """
    address = env.get("RAY_ADDRESS", "")
    if address and address != "local":
        return f"RAY_ADDRESS={address} is set, so ray.init() joins that cluster"
    path = ray_address_file(env, temp_dir)
    recorded = _read(path)
    if recorded:
        return f"'ray start' recorded the cluster at {recorded} in {path}, so ray.init() joins it"
    return None


def ray_address_file(env: Mapping[str, str], temp_dir: str | None = None) -> Path:
    """Where ``ray start`` records the cluster a plain ``ray.init()`` joins (Ray's ``get_ray_address_file``)."""
    if temp_dir is None:
        system = env["RAY_TMPDIR"] if "RAY_TMPDIR" in env else env.get("TMPDIR", "/tmp")
        temp_dir = os.path.join(system, "ray")
    return Path(temp_dir) / "ray_current_cluster"

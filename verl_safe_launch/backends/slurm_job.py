"""What a generated Slurm job runs inside its allocation: the allocation check and the wait for Ray nodes."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import LaunchError, UsageError
from verl_safe_launch.inputs import GPU_KEYS, HardwareProfile
from verl_safe_launch.launch import within

POLL_S = 1.0


def _fmt(value: object) -> str:
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def allocation_lines(view: ConfigView, profile: HardwareProfile, env: Mapping[str, str]) -> list[str]:
    """What the pre-flight saw of the Slurm allocation, next to the config's GPU counts."""
    job = env.get("SLURM_JOB_ID")
    where = f"Slurm job {job} on {env.get('SLURMD_NODENAME', '?')}" if job else "no Slurm allocation detected"
    lines = [f"allocation seen by the pre-flight ({where}):"]
    width = max(len(key) for key, _, _ in GPU_KEYS)
    for key, name, _ in GPU_KEYS:
        fact = getattr(profile, name)
        value = view.get(key)
        shown = f"  {key:<{width}} = {_fmt(value)}"
        if fact is None:
            lines.append(f"{shown}  (the allocation does not say)")
        else:
            verdict = "matches" if value == fact.value else "does NOT match"
            lines.append(f"{shown}  {verdict} {fact.source.reason}")
    return lines


@dataclass(frozen=True)
class RayNode:
    """One node of the Ray cluster as its GCS reports it."""

    name: str
    alive: bool
    resources: Mapping[str, float]

    def describe(self) -> str:
        """``n1 (2 GPU, 4 CPU)``."""
        gpus, cpus = self.resources.get("GPU", 0), self.resources.get("CPU", 0)
        return f"{self.name} ({gpus:g} GPU, {cpus:g} CPU)"


@dataclass(frozen=True)
class Joined:
    """The outcome of waiting: the nodes that joined, the hosts still missing, the seconds waited."""

    nodes: tuple[RayNode, ...]
    missing: tuple[str, ...]
    waited_s: float


def wait_for_nodes(
    hosts: Sequence[str],
    list_nodes: Callable[[], Sequence[RayNode]],
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Joined:
    """Poll the cluster until every host has a live Ray node, or the timeout passes."""
    start = clock()
    while True:
        alive = {node.name: node for node in list_nodes() if node.alive}
        missing = tuple(host for host in hosts if host not in alive)
        waited = clock() - start
        if not missing or waited >= timeout_s:
            joined = tuple(alive[host] for host in hosts if host in alive)
            return Joined(joined, missing, waited)
        sleep(min(POLL_S, max(timeout_s - waited, 0.0)))


def joined_line(result: Joined, hosts: Sequence[str]) -> str:
    """``Ray cluster ready: 2/2 nodes joined: n1 (2 GPU, 1 CPU), n2 (...)``."""
    nodes = ", ".join(node.describe() for node in result.nodes) or "none"
    return f"Ray cluster ready: {len(result.nodes)}/{len(hosts)} nodes joined: {nodes}"


def missing_error(result: Joined, hosts: Sequence[str], timeout_s: float) -> LaunchError:
    """The error naming the hosts whose Ray node never joined."""
    joined = ", ".join(node.name for node in result.nodes) or "none"
    return LaunchError(
        f"Ray nodes on {', '.join(result.missing)} did not join within {timeout_s:g} s "
        f"({len(result.nodes)}/{len(hosts)} joined: {joined})",
        where="the job's Ray cluster",
        fix="see ray-worker-<host>.log in the job's log directory; raise --join-timeout for slow nodes",
    )


_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]{1,5}")


def ray_node_lister(address: str, timeout_s: float = 60.0) -> Callable[[], list[RayNode]]:
    """Connect to the job's Ray cluster (as a client) within ``timeout_s`` and return a function listing its nodes.

    ``ray.init`` has no timeout of its own, so it runs in a daemon thread that is abandoned at the deadline.
    """
    if not _ADDRESS.fullmatch(address):
        raise UsageError(
            f"--address {address!r} is not a Ray GCS address (HOST:PORT)",
            where="command line (--address)",
            fix="e.g. --address 10.0.0.1:6379",
        )
    # Import here, not in the thread: an import the thread is still doing when Ctrl-C ends the main thread holds
    # the import lock, and the interpreter's exit then waits on it for ever.
    import ray

    try:
        within(lambda: _ray_init(address), timeout_s)
    except TimeoutError:
        raise LaunchError(
            f"cannot reach the job's Ray head at {address} within {timeout_s:g} s",
            where="RAY_ADDRESS of the job",
            fix="see ray-head-<host>.log in the job's log directory",
        ) from None
    except Exception as exc:
        raise LaunchError(
            f"cannot reach the job's Ray head at {address}: {exc}",
            where="RAY_ADDRESS of the job",
            fix="see ray-head-<host>.log in the job's log directory",
        ) from None

    def list_nodes() -> list[RayNode]:
        return [_node(info) for info in ray.nodes()]  # type: ignore[no-untyped-call]

    return list_nodes


def _ray_init(address: str) -> None:
    import logging

    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)


def _node(info: Mapping[str, Any]) -> RayNode:
    return RayNode(str(info.get("NodeName", "")), bool(info.get("Alive")), dict(info.get("Resources") or {}))

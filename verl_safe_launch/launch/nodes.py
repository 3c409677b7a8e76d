"""Per-node checks of a Ray cluster against what verl places on each node (one STRICT_PACK bundle set per node)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import InputError, LaunchError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.rules import CPUS_PER_GPU, cpu_need, gpu_need


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node as the cluster reports it: totals of GPUs, CPUs and memory, and its accelerator type."""

    node_id: str
    host: str
    alive: bool
    gpus: float
    cpus: float
    memory_gb: float
    accelerator: str | None = None

    @property
    def label(self) -> str:
        """``10.0.0.2 (node 3f2a…)``."""
        return f"{self.host} (node {self.node_id[:8]})"


@dataclass(frozen=True)
class NodeNeed:
    """What verl asks of every node, and what it needs somewhere in the cluster on top."""

    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    extra_cpus: int


def node_need(view: ConfigView) -> NodeNeed:
    """verl's trainer pool: ``trainer.nnodes`` bundle sets of ``n_gpus_per_node`` × {GPU 1, CPU 3}, one per node;
    the TransferQueue and scheduling CPUs anywhere."""
    per_node = _int(view.get("trainer.n_gpus_per_node"))
    nodes = _int(view.get("trainer.nnodes"))
    cpus = cpu_need(view, gpu_need(view))
    return NodeNeed(nodes, per_node, CPUS_PER_GPU * per_node, cpus.transfer_queue + cpus.headroom)


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def nodes_from_ray(entries: Sequence[Mapping[str, Any]]) -> list[NodeInfo]:
    """Nodes from ``ray.nodes()`` (a connected driver)."""
    out: list[NodeInfo] = []
    for entry in entries:
        node_id = str(entry.get("NodeID", ""))
        host = str(entry.get("NodeManagerAddress") or entry.get("NodeName") or "?")
        resources = _resources(entry.get("Resources"), host, node_id)
        out.append(
            NodeInfo(node_id, host, bool(entry.get("Alive")), *resources[:3], _accelerator(resources[3]))
        )
    return out


def _resources(found: Any, host: str, node_id: str) -> tuple[float, float, float, Mapping[str, Any]]:
    """GPUs, CPUs and memory (GiB) of one node's answer, and all its resources; a total that is not a finite
    number of at least 0 is a malformed answer (InputError, exit 2), never a traceback."""
    resources: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    if found is not None and not isinstance(found, Mapping):
        raise _malformed(f"resources {found!r}", host, node_id)
    amounts = []
    for name in ("GPU", "CPU", "memory"):
        value = resources.get(name, 0)
        try:
            amount = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError, OverflowError):
            amount = math.nan
        if not (math.isfinite(amount) and amount >= 0):
            raise _malformed(f'"{name}": {value!r}', host, node_id)
        amounts.append(amount)
    return amounts[0], amounts[1], amounts[2] / 2**30, resources


def _malformed(what: str, host: str, node_id: str) -> InputError:
    shown = what if len(what) <= 80 else what[:77] + "..."
    return InputError(
        f"the Ray cluster reported {shown} for node {host} ({node_id[:8]}): not a count of resources",
        where="the cluster's list of nodes",
        fix="check the address: it must be a Ray cluster's dashboard; on the cluster, 'ray status' shows what "
        "its nodes hold",
    )


def nodes_from_state(entries: Sequence[Any]) -> list[NodeInfo]:
    """Nodes from Ray's state API (``ray.util.state.list_nodes(detail=True)``), read over the dashboard."""
    out: list[NodeInfo] = []
    for entry in entries:
        data = entry if isinstance(entry, Mapping) else getattr(entry, "__dict__", {})
        node_id = str(data.get("node_id", ""))
        host = str(data.get("node_ip") or data.get("node_name") or "?")
        resources = _resources(data.get("resources_total"), host, node_id)
        alive = str(data.get("state", "")).upper() == "ALIVE"
        out.append(NodeInfo(node_id, host, alive, *resources[:3], _accelerator(resources[3])))
    return out


def _accelerator(resources: Mapping[str, Any]) -> str | None:
    names = sorted(str(k).split(":", 1)[1] for k in resources if str(k).startswith("accelerator_type:"))
    return names[0] if names else None


def node_findings(nodes: Sequence[NodeInfo], need: NodeNeed, where: str) -> list[Finding]:
    """Every reason verl could not place its bundle sets on these nodes, per node, with both numbers."""
    alive = [n for n in nodes if n.alive]
    gpu_nodes = [n for n in alive if n.gpus > 0]
    if need.nodes <= 0 or need.gpus_per_node <= 0:
        return []
    holds = [n for n in gpu_nodes if n.gpus >= need.gpus_per_node and n.cpus >= need.cpus_per_node]
    findings: list[Finding] = []
    if len(holds) < need.nodes:
        findings.append(_too_few(alive, holds, need, where))
    findings += _mixed(gpu_nodes, need, where, blocking=len(holds) < need.nodes)
    spare = sum(n.cpus for n in alive) - need.cpus_per_node * min(need.nodes, len(holds))
    if len(holds) >= need.nodes and spare < need.extra_cpus:
        message = (
            f"after verl's {need.nodes} bundle set(s) ({need.cpus_per_node} CPUs each) the cluster has {spare:g} "
            f"CPUs left, fewer than the {need.extra_cpus} the TransferQueue and the task runner need; "
            "they would wait forever"
        )
        findings.append(_finding("cluster-node-cpus", Severity.ERROR, message, "add CPUs to a node", where))
    return findings


def _too_few(alive: Sequence[NodeInfo], holds: Sequence[NodeInfo], need: NodeNeed, where: str) -> Finding:
    short = [
        f"{n.label} has {n.gpus:g} GPUs and {n.cpus:g} CPUs"
        for n in alive
        if n not in holds and (n.gpus > 0 or not holds)
    ]
    message = (
        f"trainer.nnodes={need.nodes} asks for {need.nodes} node(s) that each hold trainer.n_gpus_per_node="
        f"{need.gpus_per_node} GPUs and {need.cpus_per_node} CPUs (verl places one STRICT_PACK bundle set per node), "
        f"but {len(holds)} of the {len(alive)} alive node(s) can"
        + (": " + "; ".join(short) if short else "")
        + "; verl would wait forever for its placement groups"
    )
    return _finding("cluster-node-short", Severity.ERROR, message, _short_fix(alive, need), where)


def _short_fix(alive: Sequence[NodeInfo], need: NodeNeed) -> str:
    """The first change with which every bundle set is placed (re-checked on these nodes), else what to add."""
    options = [(f"trainer.nnodes={n}", replace(need, nodes=n)) for n in range(need.nodes - 1, 0, -1)]
    options += [
        (f"trainer.n_gpus_per_node={g}", replace(need, gpus_per_node=g, cpus_per_node=CPUS_PER_GPU * g))
        for g in range(need.gpus_per_node - 1, 0, -1)
    ]
    fixes = [text for text, changed in options if _placeable(alive, changed)]
    if fixes:
        return fixes[0]
    if any(n.gpus >= need.gpus_per_node for n in alive):
        each, one = need.cpus_per_node, need.cpus_per_node + need.extra_cpus
        return (
            f"start the nodes' Ray with more logical CPUs: each at least {each}, one at least {one} "
            f"(ray start --num-cpus={one}; oversubscribing is fine)"
        )
    return "add GPU nodes to the cluster"


def _placeable(alive: Sequence[NodeInfo], need: NodeNeed) -> bool:
    """Every bundle set finds a node, and the CPUs left hold the TransferQueue and the task runner."""
    holds = [n for n in alive if n.gpus >= need.gpus_per_node and n.cpus >= need.cpus_per_node]
    spare = sum(n.cpus for n in alive) - need.cpus_per_node * min(need.nodes, len(holds))
    return len(holds) >= need.nodes and spare >= need.extra_cpus


def _mixed(gpu_nodes: Sequence[NodeInfo], need: NodeNeed, where: str, *, blocking: bool) -> list[Finding]:
    counts = sorted({n.gpus for n in gpu_nodes})
    kinds = sorted({n.accelerator or "?" for n in gpu_nodes})
    findings: list[Finding] = []
    if len(counts) > 1:
        per = ", ".join(f"{n.label}: {n.gpus:g}" for n in gpu_nodes)
        message = f"GPU nodes differ in GPU count ({per}); verl does not support mixed GPU counts per node"
        severity = Severity.ERROR if blocking else Severity.WARNING
        findings.append(_finding("cluster-heterogeneous", severity, message, "use nodes of one shape", where))
    if len(kinds) > 1:
        message = f"GPU nodes carry different accelerator types ({', '.join(kinds)})"
        findings.append(
            _finding("cluster-heterogeneous", Severity.WARNING, message, "use one GPU type", where)
        )
    return findings


def _finding(rule_id: str, severity: Severity, message: str, fix: str, where: str) -> Finding:
    source = Source(Layer.HARDWARE, reason=where)
    return Finding(
        rule_id,
        severity,
        ("trainer.nnodes", "trainer.n_gpus_per_node"),
        message,
        fix,
        (("cluster", where, source),),
    )


def live_nodes() -> list[NodeInfo]:
    """The nodes of the Ray cluster this driver is connected to."""
    import ray

    return nodes_from_ray(ray.nodes())  # type: ignore[no-untyped-call]


def blocking(findings: Sequence[Finding]) -> LaunchError | None:
    """The first node-check error as the error that stops the launch (None when nothing blocks); Ray is up by
    then, so it reads as a launch that started and failed (exit 3)."""
    errors = [f for f in findings if f.severity is Severity.ERROR]
    if not errors:
        return None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return LaunchError(
        errors[0].message + more,
        where=str(errors[0].sources[0][1]) if errors[0].sources else None,
        fix=errors[0].fix,
    )

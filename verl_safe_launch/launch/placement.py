"""Ask Ray for verl's placement groups ahead of verl, with a deadline instead of verl's endless ``pg.ready()``."""

from __future__ import annotations

from collections.abc import Sequence

from verl_safe_launch.errors import LaunchError
from verl_safe_launch.launch.nodes import NodeInfo, NodeNeed

DEFAULT_TIMEOUT_S = 60.0


def bundles(need: NodeNeed, device: str = "GPU") -> list[list[dict[str, float]]]:
    """The bundle sets verl's ``RayResourcePool.get_placement_groups`` asks for: one per node, each of
    ``n_gpus_per_node`` bundles ``{CPU: max_colocate_count, GPU: 1}`` (verl 0.9.1, single_controller/ray/base.py)."""
    bundle = {"CPU": float(need.cpus_per_node // max(need.gpus_per_node, 1)), device: 1.0}
    return [[dict(bundle) for _ in range(need.gpus_per_node)] for _ in range(need.nodes)]


def probe_placement(need: NodeNeed, nodes: Sequence[NodeInfo], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Create verl's STRICT_PACK groups in a connected driver, wait at most ``timeout_s``, then remove them.

    Raises a LaunchError naming what no node could provide, where verl itself would wait forever.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = [placement_group(b, strategy="STRICT_PACK") for b in bundles(need)]
    try:
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        placed = len(ready)
    finally:
        for group in groups:
            remove_placement_group(group)
    if placed < len(groups):
        shapes = "; ".join(f"{n.label}: {n.gpus:g} GPUs, {n.cpus:g} CPUs" for n in nodes if n.alive) or "none"
        raise LaunchError(
            f"only {placed} of verl's {len(groups)} placement groups ({need.gpus_per_node} GPUs and "
            f"{need.cpus_per_node} CPUs on one node each) could be placed within {timeout_s:g} s; alive nodes: "
            f"{shapes}",
            where="Ray placement groups (STRICT_PACK, one per node)",
            fix="match trainer.nnodes / trainer.n_gpus_per_node to the nodes, or free their resources",
        )

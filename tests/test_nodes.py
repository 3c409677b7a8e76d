"""Per-node checks: verl places one bundle set of n_gpus_per_node GPUs (and their CPUs) on each of nnodes nodes."""

from __future__ import annotations

import pytest

from verl_safe_launch.compose import compose
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.launch import NodeInfo, NodeNeed, bundles, node_findings, node_need, nodes_from_ray


def node(name: str, gpus: float, cpus: float, alive: bool = True, kind: str | None = "A100") -> NodeInfo:
    return NodeInfo(f"{name}-id-0000", name, alive, gpus, cpus, 512.0, kind)


NEED = NodeNeed(nodes=2, gpus_per_node=8, cpus_per_node=24, extra_cpus=10)


def errors(nodes: list[NodeInfo], need: NodeNeed = NEED) -> list[str]:
    return [f.message for f in node_findings(nodes, need, "test cluster") if f.severity is Severity.ERROR]


def test_two_full_nodes_hold_the_run() -> None:
    assert node_findings([node("a", 8, 40), node("b", 8, 40)], NEED, "test cluster") == []


def test_enough_gpus_in_total_but_not_per_node_is_refused_naming_the_node() -> None:
    found = errors([node("a", 8, 40), node("b", 4, 40), node("c", 4, 40)])
    assert any(
        "1 of the 3 alive node(s) can" in m and "b (node b-id-000) has 4 GPUs and 40 CPUs" in m for m in found
    )
    assert any("mixed GPU counts" in m for m in found)


def test_a_node_short_of_cpus_cannot_hold_a_bundle_set() -> None:
    found = errors([node("a", 8, 40), node("b", 8, 16)])
    assert found and "b (node b-id-000) has 8 GPUs and 16 CPUs" in found[0]


def test_dead_nodes_do_not_count() -> None:
    assert errors([node("a", 8, 40), node("b", 8, 40, alive=False)])


def test_spare_cpus_for_the_transfer_queue() -> None:
    found = errors([node("a", 8, 24), node("b", 8, 24)])
    assert found and "fewer than the 10 the TransferQueue and the task runner need" in found[0]


def test_more_nodes_of_another_shape_are_only_a_warning() -> None:
    found = node_findings([node("a", 8, 40), node("b", 8, 40), node("c", 4, 40)], NEED, "test cluster")
    assert [f.severity for f in found] == [Severity.WARNING]


def test_mixed_accelerator_types_warn() -> None:
    found = node_findings([node("a", 8, 40, kind="A100"), node("b", 8, 40, kind="H100")], NEED, "x")
    assert [f.severity for f in found] == [Severity.WARNING] and "A100, H100" in found[0].message


@pytest.mark.parametrize(("per_node", "nodes"), [(8, 1), (4, 2)])
def test_need_follows_the_config(per_node: int, nodes: int) -> None:
    tokens = cli_tokens([f"trainer.n_gpus_per_node={per_node}", f"trainer.nnodes={nodes}"])
    need = node_need(compose(ComposeRequest(overrides=tokens)).view)
    assert (need.nodes, need.gpus_per_node, need.cpus_per_node) == (nodes, per_node, 3 * per_node)
    assert need.extra_cpus > 0  # the V1 trainer's TransferQueue
    assert len(bundles(need)) == nodes and all(len(b) == per_node for b in bundles(need))


def test_nodes_from_ray_reads_ray_nodes_entries() -> None:
    entries = [
        {
            "NodeID": "abcdef0123",
            "Alive": True,
            "NodeManagerAddress": "10.0.0.2",
            "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 64 * 2**30, "accelerator_type:H100": 1.0},
        }
    ]
    (info,) = nodes_from_ray(entries)
    assert (info.host, info.gpus, info.cpus, info.memory_gb, info.accelerator) == (
        "10.0.0.2",
        8,
        32,
        64,
        "H100",
    )


def _short_fix(nodes: list[NodeInfo], need: NodeNeed) -> str:
    [short] = [f for f in node_findings(nodes, need, "test cluster") if f.rule_id == "cluster-node-short"]
    return short.fix or ""


def _applied(need: NodeNeed, fix: str) -> NodeNeed:
    key, _, value = fix.partition("=")
    if key == "trainer.nnodes":
        return NodeNeed(int(value), need.gpus_per_node, need.cpus_per_node, need.extra_cpus)
    assert key == "trainer.n_gpus_per_node", fix
    return NodeNeed(need.nodes, int(value), 3 * int(value), need.extra_cpus)


@pytest.mark.parametrize(
    ("nodes", "need"),
    [
        ([node("a", 2, 2)], NodeNeed(1, 2, 6, 10)),  # the CPUs are short, not the GPUs
        ([node("a", 8, 40), node("b", 8, 16)], NEED),
        ([node("a", 4, 40), node("b", 4, 40)], NEED),
        ([node("a", 8, 64)], NodeNeed(2, 8, 24, 10)),
    ],
)
def test_the_short_node_fix_never_repeats_the_value_and_passes_the_re_check(
    nodes: list[NodeInfo], need: NodeNeed
) -> None:
    fix = _short_fix(nodes, need)
    assert fix not in (f"trainer.n_gpus_per_node={need.gpus_per_node}", f"trainer.nnodes={need.nodes}")
    if "=" in fix.split()[0] and fix.startswith("trainer."):
        blocking = [f for f in node_findings(nodes, _applied(need, fix), "t") if f.severity is Severity.ERROR]
        assert blocking == [], fix
    else:
        assert "--num-cpus=" in fix or "add GPU nodes" in fix


def test_a_node_short_of_cpus_only_is_told_to_start_ray_with_more() -> None:
    assert _short_fix([node("a", 2, 2)], NodeNeed(1, 2, 6, 10)) == (
        "start the nodes' Ray with more logical CPUs: each at least 6, one at least 16 (ray start --num-cpus=16; "
        "oversubscribing is fine)"
    )

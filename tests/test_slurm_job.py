"""Inside the job: the allocation seen by the pre-flight, and waiting for every node's Ray to join."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from verl_safe_launch.backends import (
    Joined,
    RayNode,
    allocation_lines,
    joined_line,
    missing_error,
    wait_for_nodes,
)
from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, ToolSettings, cli_tokens, detect_hardware

SLURM_ENV = {
    "SLURM_JOB_ID": "7",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "1",
    "SLURM_GPUS_ON_NODE": "2",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "PATH": "/nonexistent",
}


@pytest.mark.parametrize(
    ("gpus", "verdict"),
    [
        ("2", "matches Slurm allocation, SLURM_GPUS_ON_NODE=2"),
        ("4", "does NOT match Slurm allocation, SLURM_GPUS_ON_NODE=4"),
    ],
)
def test_allocation_lines(gpus: str, verdict: str) -> None:
    view = compose(
        ComposeRequest(overrides=cli_tokens(["trainer.n_gpus_per_node=2", "trainer.nnodes=2"]))
    ).view
    env = {**SLURM_ENV, "SLURM_GPUS_ON_NODE": gpus, "CUDA_VISIBLE_DEVICES": ",".join("0123"[: int(gpus)])}
    profile = detect_hardware(ToolSettings(), env)
    assert allocation_lines(view, profile, env) == [
        "allocation seen by the pre-flight (Slurm job 7 on n1):",
        f"  trainer.n_gpus_per_node = 2  {verdict}",
        # SLURM_NNODES is the step's node count inside srun; the job's is SLURM_JOB_NUM_NODES.
        "  trainer.nnodes          = 2  matches Slurm allocation, SLURM_JOB_NUM_NODES=2",
    ]


class FakeCluster:
    """Nodes that join one by one, on a clock that advances only when the waiter sleeps."""

    def __init__(self, joins: dict[str, float]) -> None:
        self.joins = joins
        self.now = 0.0
        self.polls = 0

    def nodes(self) -> Sequence[RayNode]:
        self.polls += 1
        return [RayNode(h, True, {"GPU": 8.0, "CPU": 34.0}) for h, t in self.joins.items() if t <= self.now]

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waits_until_every_host_joined() -> None:
    cluster = FakeCluster({"n1": 0, "n2": 3, "n3": 5})
    result = wait_for_nodes(
        ["n1", "n2", "n3"], cluster.nodes, 60, clock=lambda: cluster.now, sleep=cluster.sleep
    )
    assert result.missing == ()
    assert cluster.now == 5
    assert joined_line(result, ["n1", "n2", "n3"]) == (
        "Ray cluster ready: 3/3 nodes joined: n1 (8 GPU, 34 CPU), n2 (8 GPU, 34 CPU), n3 (8 GPU, 34 CPU)"
    )


def test_names_the_missing_hosts_at_the_timeout() -> None:
    cluster = FakeCluster({"n1": 0, "n3": 1})
    hosts = ["n1", "n2", "n3", "n4"]
    result = wait_for_nodes(hosts, cluster.nodes, 10, clock=lambda: cluster.now, sleep=cluster.sleep)
    assert result.missing == ("n2", "n4")
    assert cluster.now == 10
    error = missing_error(result, hosts, 10)
    assert error.render() == (
        "error: Ray nodes on n2, n4 did not join within 10 s (2/4 joined: n1, n3)\n"
        "  where: the job's Ray cluster\n"
        "  fix: see ray-worker-<host>.log in the job's log directory; raise --join-timeout for slow nodes"
    )
    assert error.exit_code == 3


def test_dead_nodes_do_not_count() -> None:
    dead = [RayNode("n1", True, {}), RayNode("n2", False, {})]
    result = wait_for_nodes(["n1", "n2"], lambda: dead, 0)
    assert result == Joined((dead[0],), ("n2",), result.waited_s)

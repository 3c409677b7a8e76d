"""submit: the pre-flight here, the cluster's nodes checked one by one, then the run as a job of a real Ray cluster.

The cluster is ``ray.cluster_utils.Cluster``: a head and two worker raylets on this machine, real processes on
loopback ports with declared (fake) GPUs and the job server, started by the module and stopped by PID. With no GPU
here the job reaches verl's task runner and fails where CUDA is first needed: exit 3, the cause in the job's logs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult, make_tiny_model

from verl_safe_launch.backends import JobTarget, submit_job
from verl_safe_launch.errors import UsageError

# The module's Ray cluster starts once: under pytest-xdist the whole module runs on one worker.
pytestmark = pytest.mark.xdist_group("ray-submit")
GRPO = str(EXAMPLES / "grpo_6gpu.yaml")


def test_unreachable_address_is_one_line_within_seconds(cli: Callable[..., CliResult]) -> None:
    started = time.monotonic()
    result = cli("submit", "--address", "http://127.0.0.1:9", "-c", GRPO, "hardware.gpu_memory_gb=80")
    assert result.code == 2
    assert result.err.startswith("error: cannot reach the job API at http://127.0.0.1:9 (--address)")
    assert "Traceback" not in result.err
    assert time.monotonic() - started < 60  # bounded by the connect deadline, not a hang


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "ray://head:10001"])
def test_the_address_must_be_the_job_api(cli: Callable[..., CliResult], address: str) -> None:
    result = cli("submit", "--address", address, "-c", GRPO)
    assert result.code == 2
    assert "is not the address of a Ray job API" in result.err and "http://HEAD:8265" in result.err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A head (no GPU) and two GPU raylets of different shapes (2 and 1 declared GPUs); yields the job API URL."""
    from ray.cluster_utils import Cluster

    temp = Path(tempfile.mkdtemp(prefix="vslsubmit"))
    port = _free_port()
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith(("RAY_", "VSL_"))]:
            mp.delenv(name)
        mp.setenv("HOME", str(temp / "home"))  # no ~/.ray token: Ray's default (no auth) for this cluster
        # Cluster() writes the head's address to RAY_TMPDIR/ray/ray_current_cluster (by default under /tmp/ray,
        # which exists only where Ray ran before): keep it, and every raylet's session, in this test's own dir.
        mp.setenv("RAY_TMPDIR", str(temp))
        # The cluster's own processes (dashboard, job supervisors) make multiprocessing temp dirs that a killed
        # process never removes: they go to this dir too, removed with it.
        mp.setenv("TMPDIR", str(temp))
        (temp / "ray").mkdir()
        mp.setenv(
            "PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        )  # the job's python
        head = {"num_cpus": 4, "num_gpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1"}
        made = Cluster(
            initialize_head=True,
            connect=False,
            # The head's job agent listens on 52365 unless told: a second Ray on this machine (another test
            # worker's) would take it, and the job API then answers "No available agent".
            head_node_args={
                **head,
                "dashboard_port": port,
                "dashboard_agent_listen_port": _free_port(),
                "temp_dir": str(temp / "ray"),
            },
        )
        try:
            made.add_node(num_cpus=12, num_gpus=2)
            made.add_node(num_cpus=8, num_gpus=1)
            mp.setenv("VSL_TEST_GCS", made.address)  # for the placement probe below
            yield f"http://127.0.0.1:{port}"
        finally:
            made.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def _data(folder: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": f"{i} + 1 ="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(8)
    ]
    path = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _jobs(address: str) -> list[object]:
    from ray.job_submission import JobSubmissionClient

    return list(JobSubmissionClient(address).list_jobs())


def _small_run(tmp_path: Path, *, nodes: int) -> list[str]:
    """A tiny GRPO run on 2 GPUs per node: a local tiny model and a small parquet file (no download)."""
    model = make_tiny_model(tmp_path / "tiny")
    data = _data(tmp_path)
    return [
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.n_gpus_per_node=2",
        f"trainer.nnodes={nodes}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.max_prompt_length=16",
        "data.max_response_length=16",
        "trainer.logger=[console]",
    ]


@pytest.mark.slow
def test_a_cluster_whose_nodes_cannot_hold_the_run_is_refused_per_node(
    cluster: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    args = _small_run(tmp_path, nodes=2)
    result = cli("submit", "--address", cluster, "--run-dir", str(tmp_path / "run"), *args)
    assert result.code == 1, result.out + result.err
    assert "cluster " + cluster in result.out and "3 alive node(s)" in result.out
    assert "trainer.nnodes=2 asks for 2 node(s)" in result.out
    assert "but 1 of the 3 alive node(s) can" in result.out and "has 1 GPUs and 8 CPUs" in result.out
    assert "Nothing was submitted" in result.out
    assert _jobs(cluster) == []


@pytest.mark.slow
def test_submit_runs_the_launch_on_the_cluster_and_reports_its_end(
    cluster: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = _small_run(tmp_path, nodes=1)
    result = cli("submit", "--address", cluster, "--follow", "--run-dir", str(run_dir), *args)
    job = json.loads((run_dir / "job.json").read_text())
    assert f"submitted job {job['job_id']} to {cluster}" in result.out
    assert "verl_safe_launch run --attach" in job["entrypoint"]
    assert result.code == 3, result.out[-3000:] + result.err
    assert "launching:" in result.out  # the job's own run got past the pre-flight on the cluster
    assert "ended: FAILED" in result.err


@pytest.mark.slow
def test_placement_probe_gives_up_naming_the_nodes_where_verl_would_wait_forever(cluster: str) -> None:
    import ray

    from verl_safe_launch.errors import LaunchError
    from verl_safe_launch.launch import NodeNeed, live_nodes, probe_placement

    ray.init(address=os.environ["VSL_TEST_GCS"])
    try:
        nodes = live_nodes()
        probe_placement(
            NodeNeed(nodes=1, gpus_per_node=2, cpus_per_node=6, extra_cpus=0), nodes, timeout_s=30
        )
        with pytest.raises(LaunchError) as caught:
            probe_placement(
                NodeNeed(nodes=2, gpus_per_node=2, cpus_per_node=6, extra_cpus=0), nodes, timeout_s=3
            )
    finally:
        ray.shutdown()
    assert "only 1 of verl's 2 placement groups" in caught.value.what
    assert "2 GPUs, 12 CPUs" in caught.value.what and "1 GPUs, 8 CPUs" in caught.value.what


class _AgentLate:
    """A job API whose agent registers after ``late`` calls (Ray's head answers 500 until then). The real
    timing cannot be forced on a local Ray; the answer's text is Ray's own (dashboard/modules/job/job_head.py)."""

    def __init__(self, late: int) -> None:
        self.late, self.calls = late, 0

    def submit_job(self, **job: object) -> str:
        self.calls += 1
        if self.calls <= self.late:
            raise RuntimeError(
                "Request failed with status code 500: No available agent to submit job, please try again later."
            )
        return "raysubmit_ok"


def test_a_head_whose_job_agent_is_not_up_yet_is_asked_again() -> None:
    target = JobTarget("http://127.0.0.1:8265", "--address")
    client = _AgentLate(2)
    assert submit_job(client, target, wait_s=30, entrypoint="true") == "raysubmit_ok"
    assert client.calls == 3
    with pytest.raises(UsageError, match="No available agent to submit job"):
        submit_job(_AgentLate(100), target, wait_s=0, entrypoint="true")

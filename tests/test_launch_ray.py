"""On a real local Ray (own temp dir, shut down by the module): the memory hook lands in the workers of verl's
own RayWorkerGroup, the launcher's GPU check refuses a cluster with too few GPUs before submitting anything, and a
client without the cluster's token gets one clear error. The Ray here starts as on a fresh machine: no ``RAY_*``
variables and no ``~/.ray`` (a temp HOME), so it runs with Ray's default token authentication.

No GPU here: the worker group uses ``RayResourcePool(..., use_gpu=False)`` and the cluster declares 2 logical GPUs;
the CUDA side of the records is exercised by ``bench/gpu_launch_smoke.py`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, CliResult, fresh_ray_env

from verl_safe_launch.launch import NO_CUDA_NOTE, RUN_DIR_ENV, SETUP_HOOK

# The module's Ray starts once: under pytest-xdist the whole module runs on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray-hooks")]
CLUSTER_GPUS = 2


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[str, Path]]:
    """A local Ray for this module; every worker gets the memory hook and the module's run directory."""
    import ray

    temp = Path(tempfile.mkdtemp(prefix="vslray"))
    run_dir = temp / "run"
    run_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        fresh_ray_env(mp, temp / "home", tmpdir=temp)
        ray.init(
            address="local",
            num_cpus=32,
            num_gpus=CLUSTER_GPUS,
            include_dashboard=False,
            _temp_dir=str(temp / "ray"),
            runtime_env={"worker_process_setup_hook": SETUP_HOOK, "env_vars": {RUN_DIR_ENV: str(run_dir)}},
            _system_config={"prestart_worker_first_driver": False},
        )
        try:
            yield ray.get_runtime_context().gcs_address, run_dir
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def _probe_worker_class() -> type:
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register
    from verl.single_controller.base.worker import Worker
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class StubRef:
        """The ref TrainingWorker's surface that compute_ref_log_prob touches: infer_batch and engine_config."""

        def __init__(self) -> None:
            self.engine_config = type(
                "Engine", (), {"use_dynamic_bsz": False, "infer_micro_batch_size_per_gpu": 2}
            )()

        def infer_batch(self, data: Any) -> Any:
            return data

    class ProbeWorker(ActorRolloutRefWorker):  # type: ignore[misc]
        """verl's ActorRolloutRefWorker without models: its own compute_ref_log_prob runs on a stub ref."""

        def __init__(self) -> None:
            Worker.__init__(self)
            self.ref = StubRef()
            self.enable_routing_replay = False
            self._register_dispatch_collect_info(mesh_name="ref", dp_rank=self.rank, is_collect=True)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def inspect_hook(self) -> dict[str, object]:
            method = ActorRolloutRefWorker.__dict__["compute_ref_log_prob"]
            return {"wrapped": hasattr(method, "__wrapped__"), "magic": hasattr(method, MAGIC_ATTR)}

    return ProbeWorker


def test_hook_lands_in_verls_worker_group_and_a_call_writes_a_json_line(
    ray_cluster: tuple[str, Path],
) -> None:
    import ray
    import torch
    from tensordict import TensorDict
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    _, run_dir = ray_cluster
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(
        pool, RayClassWithInitArgs(cls=ray.remote(_probe_worker_class())), device_name="cpu"
    )
    assert group.inspect_hook() == [{"wrapped": True, "magic": True}] * 2
    data = TensorDict({"x": torch.arange(4).unsqueeze(1)}, batch_size=[4])
    output = group.compute_ref_log_prob(data)
    assert output["x"].flatten().tolist() == [0, 1, 2, 3]
    records = {}
    for rank in (0, 1):
        (line,) = (run_dir / f"memory-{rank}.jsonl").read_text().splitlines()
        records[rank] = json.loads(line)
    assert {r["stage"] for r in records.values()} == {"ref_log_prob"}
    assert [records[rank]["rank"] for rank in (0, 1)] == [0, 1]
    record = records[0]
    assert record["status"] == "ok"
    assert record["settings"]["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] == 2
    assert record["knobs"] == ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"]
    assert (record["cuda"], record["note"]) == (False, NO_CUDA_NOTE)


def test_run_refuses_a_cluster_with_too_few_gpus_before_submitting(
    ray_cluster: tuple[str, Path],
    cli: Callable[..., CliResult],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address, _ = ray_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    run_dir = tmp_path / "run"
    result = cli("run", "-c", str(EXAMPLES / "grpo_6gpu.yaml"), "--run-dir", str(run_dir))
    assert result.code == 3
    report = result.err[result.err.index("error: ") :]  # verl's own validation chatter comes first
    assert report.splitlines()[0] == (
        "error: the Ray cluster has 2 GPUs; the config needs 6 "
        "(global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1)"
    )
    assert not (run_dir / "task_runner.json").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["config.yaml", "overrides.txt", "provenance.json", "preflight.json", "command.sh"]
    )
    import ray

    assert ray.is_initialized()  # the launcher leaves a Ray it did not start alone


def test_attaching_without_the_clusters_token_is_one_clear_error(
    ray_cluster: tuple[str, Path], tmp_path: Path
) -> None:
    """This module's Ray uses token auth (Ray's default); a new shell with no token attaches to it with none."""
    address, _ = ray_cluster
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    (tmp_path / "home").mkdir()
    env.update(HOME=str(tmp_path / "home"), RAY_ADDRESS=address)
    env["RAY_gcs_server_port_wait_time_s"] = "2"  # Ray's connect retries (20 s by default), not auth
    run_dir = tmp_path / "run"
    command = [str(Path(sys.executable).with_name("verl-safe-launch")), "run", "--run-dir", str(run_dir)]
    result = subprocess.run(
        [*command, "-c", str(EXAMPLES / "grpo_6gpu.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines[-3:] == [
        f"error: the Ray cluster at {address} refused this process: it uses token authentication and this "
        "process has no token (RAY_AUTH_MODE=disabled: no token available)",
        f"  where: {address} (RAY_ADDRESS); run directory {run_dir}",
        "  fix: use the cluster's token: RAY_AUTH_TOKEN=... or RAY_AUTH_TOKEN_PATH=FILE (as on its nodes), "
        "or start the cluster with RAY_AUTH_MODE=disabled on every node",
    ]
    assert "Ray auth:     disabled (no token available)" in result.stdout

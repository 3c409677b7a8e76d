"""The whole ``run`` path on a tiny generated model and dataset, up to verl's own task runner on a real local Ray.

No GPU here, so the nearest real boundary is verl's resource-pool check inside the task runner: the launch must end
with verl's own "Total available GPUs 0 ..." error, reported in one line with exit 3, a complete run directory, and
proof that the task runner received exactly config.yaml. ``--force`` is what lets the launch go ahead without GPUs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult, make_tiny_model

from verl_safe_launch.launch import RUN_FILES, config_digest

pytestmark = pytest.mark.slow


def make_tiny_dataset(path: Path, rows: int = 4) -> Path:
    """A parquet file in verl's RL dataset layout (chat prompt, data source, ground truth)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "data_source": ["openai/gsm8k"] * rows,
            "prompt": [[{"role": "user", "content": f"the a of {i}"}] for i in range(rows)],
            "ability": ["math"] * rows,
            "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(rows)],
            "extra_info": [{"split": "train", "index": i} for i in range(rows)],
        }
    )
    pq.write_table(table, path)
    return path


def test_run_reaches_verls_task_runner_and_reports_its_gpu_error(
    cli: Callable[..., CliResult],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = make_tiny_model(tmp_path / "tiny-model")
    data = make_tiny_dataset(tmp_path / "train.parquet")
    ray_temp = tempfile.mkdtemp(prefix="vslray")  # short: Ray's socket paths must fit in 107 characters
    request.addfinalizer(lambda: shutil.rmtree(ray_temp, ignore_errors=True))
    run_dir = tmp_path / "run"
    result = cli(
        "run",
        "--force",
        "--run-dir",
        str(run_dir),
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.train_batch_size=2",
        "data.max_prompt_length=16",
        "data.max_response_length=16",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        f"+ray_kwargs.ray_init._temp_dir={ray_temp}",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "data.dataloader_num_workers=0",
    )
    assert result.code == 3, result.err
    # Ray and verl log to stderr too; the launcher's own report is the last block
    report = result.err.splitlines()[-3:]
    assert report[:2] == [
        "error: the launch failed: ValueError: Total available GPUs 0 is less than total desired GPUs 1",
        f"  where: run directory {run_dir}",
    ]
    assert set(RUN_FILES) <= {p.name for p in run_dir.iterdir()}
    received = json.loads((run_dir / "task_runner.json").read_text())
    assert received["task_runner"] == "TaskRunnerV1"
    assert received["config_sha256"] == config_digest((run_dir / "config.yaml").read_text())
    assert received["matches_config_yaml"] is True
    preflight = json.loads((run_dir / "preflight.json").read_text())
    assert "no GPU on this machine" in preflight["forced"]
    import ray

    assert not ray.is_initialized()  # the launcher shut down the Ray it started

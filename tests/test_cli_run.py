"""The ``run`` verb up to the launch: pre-flight gate, run directory, verl's validation, dry run and no-GPU plan.

No GPU here: the no-GPU behaviour is tested as it is; the launch itself is in test_cli_run_launch.py.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult, fresh_ray_env

from verl_safe_launch.cli._run import NO_GPU
from verl_safe_launch.launch import NEW_TOKEN, RUN_FILES

EXAMPLE = str(EXAMPLES / "grpo_6gpu.yaml")
BAD_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"


@pytest.fixture(autouse=True)
def _fresh_machine(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    fresh_ray_env(monkeypatch, tmp_path_factory.mktemp("home"))


def test_preflight_errors_start_nothing_and_exit_1(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = cli("run", "-c", EXAMPLE, BAD_MICRO, "--run-dir", str(run_dir))
    assert result.code == 1
    assert "error [batch-micro-divides-mini]" in result.out
    assert result.out.splitlines()[-1] == (
        "Nothing was started: fix the errors above, or pass --force to launch anyway."
    )
    assert not run_dir.exists()


def test_a_non_empty_run_directory_is_refused(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    result = cli("run", "-c", EXAMPLE, "--run-dir", str(tmp_path))
    assert result.code == 2
    assert result.err.splitlines() == [
        f"error: run directory {tmp_path} is not empty",
        "  where: --run-dir",
        "  fix: choose a new --run-dir, or pass --force to write into it (same-named files are replaced)",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_dry_run_writes_the_run_directory_validates_and_prints_the_plan(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run dir"
    args = [
        "-c",
        EXAMPLE,
        "--dry-run",
        "--run-dir",
        str(run_dir),
        "data.train_batch_size=60",
        "preset=medium",
    ]
    result = cli("run", *args)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert f"run directory: {run_dir}" in lines
    assert "verl's validate_config: passed" in lines
    plan = lines[lines.index("Dry run: nothing was started. This is what would launch:") + 1 :]
    assert plan[0] == "  Ray:          a new local Ray on this machine (local), RAY_AUTH_MODE=token"
    assert plan[1] == f"  Ray auth:     token (Ray's default for a new local Ray), {NEW_TOKEN}"
    assert plan[2].startswith("  GPUs needed:  ")
    assert plan[-2] == "  task runner:  verl.trainer.main_ppo.TaskRunnerV1"
    assert {p.name for p in run_dir.iterdir()} == set(RUN_FILES)
    assert (run_dir / "overrides.txt").read_text() == "data.train_batch_size=60\npreset=medium\n"
    command = shlex.split((run_dir / "command.sh").read_text().splitlines()[-1])
    assert command == [sys.executable, "-m", "verl_safe_launch", "run", *args]
    provenance = json.loads((run_dir / "provenance.json").read_text())
    by_key = {entry["key"]: entry for entry in provenance["keys"]}
    assert by_key["data.train_batch_size"]["source"]["raw"] == "data.train_batch_size=60"
    assert json.loads((run_dir / "preflight.json").read_text())["forced"] == []
    assert "train_batch_size: 60" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_without_a_gpu_run_states_the_preflight_passed_and_what_would_run(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    result = cli("-c", EXAMPLE, "--run-dir", str(run_dir))
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert NO_GPU in lines
    assert lines[-1] == f"  run dir:      {run_dir}"
    assert {p.name for p in run_dir.iterdir()} == set(RUN_FILES)


@pytest.mark.slow
def test_json_dry_run_forced_into_a_non_empty_directory(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    (tmp_path / "old.txt").write_text("x\n")
    result = cli(
        "run",
        "-c",
        EXAMPLE,
        BAD_MICRO,
        "--dry-run",
        "--force",
        "--format",
        "json",
        "--run-dir",
        str(tmp_path),
    )
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["status"] == "dry-run"
    assert (data["verdict"], data["summary"]["errors"]) == ("no-go", 1)
    assert data["findings"][0]["severity"] == "error"
    assert data["plan"]["gpus_needed"] == {"total": 6, "global_pool": 6, "reward_pool": 0, "teacher_pool": 0}
    assert data["plan"]["cpus_needed"] == 28
    assert data["plan"]["task_runner"] == "verl.trainer.main_ppo.TaskRunnerV1"
    forced = json.loads((tmp_path / "preflight.json").read_text())["forced"]
    assert forced == ["pre-flight errors", "non-empty run directory"]

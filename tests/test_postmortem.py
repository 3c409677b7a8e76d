"""The post-mortem: from a recorded out-of-memory error to the knob, its safe value and the line to paste;
estimated vs measured peaks at the end of a run.

No GPU here: the OOM records are written by the real hook around a method raising torch's OutOfMemoryError,
plus one record in the shape a CUDA worker writes (device fields), as a GPU run would leave it.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import EXAMPLES

from verl_safe_launch.cli._run import Outcome, after_run
from verl_safe_launch.compose import compose
from verl_safe_launch.context import RuleContext
from verl_safe_launch.doctor import NO_CUDA_FIX, NO_FIT, oom_report, postmortem, read_records, render_peaks
from verl_safe_launch.errors import LaunchError
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.launch import RUN_DIR_ENV, STAGE_BY_NAME, wrap_stage
from verl_safe_launch.memory import KnobFit
from verl_safe_launch.preflight import rule_context

ARR = "actor_rollout_ref"
MICRO = f"{ARR}.actor.ppo_micro_batch_size_per_gpu"


def context(*overrides: str) -> RuleContext:
    request = ComposeRequest(
        overrides=cli_tokens(list(overrides)), config_files=(EXAMPLES / "grpo_6gpu.yaml",)
    )
    return rule_context(compose(request))


class Worker:
    """The surface of ActorRolloutRefWorker the hook reads, with stages that run out of memory."""

    rank = 2

    def __init__(self) -> None:
        engine = SimpleNamespace(
            use_dynamic_bsz=False, micro_batch_size_per_gpu=8, max_token_len_per_gpu=16384
        )
        self.actor = SimpleNamespace(engine_config=engine)
        rollout = SimpleNamespace(gpu_memory_utilization=0.5)
        fsdp = SimpleNamespace(param_offload=False, optimizer_offload=False)
        self.config = SimpleNamespace(rollout=rollout, actor=SimpleNamespace(fsdp_config=fsdp), ref=None)

    def runs_out(self, *args: Any, **kwargs: Any) -> None:
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.28 GiB")


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], dict[str, Any]]]:
    """Run one stage that runs out of memory under the real hook; return its record."""
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))

    def run(stage: str) -> dict[str, Any]:
        import torch

        with pytest.raises(torch.OutOfMemoryError):
            wrap_stage(Worker.runs_out, STAGE_BY_NAME[stage])(Worker(), {})
        oom = postmortem.first_oom(read_records(tmp_path))
        assert oom is not None
        return dict(oom)

    yield run


def fake_fit(ctx: RuleContext, margin: float, cap: dict[str, int]) -> tuple[KnobFit, ...]:
    assert cap == {MICRO: 7}  # strictly below the value that ran out
    reason = "actor update peaks at 31.8 GiB (limit 72.7 GiB with the margin)"
    return (KnobFit(MICRO, 8, 6, 31.8, reason, "actor update"),)


def test_oom_report_names_stage_knob_safe_value_and_the_line_to_paste(
    recorded: Callable[[str], dict[str, Any]],
) -> None:
    report = oom_report(recorded("actor_update"), context("hardware.gpu_memory_gb=80"), fake_fit)
    assert report.render(Path("outputs/run")).splitlines() == [
        "error: out of memory in stage actor_update (ActorRolloutRefWorker.update_actor), rank 2",
        "  cause: OutOfMemoryError: CUDA out of memory. Tried to allocate 9.28 GiB",
        f"  settings in force: {ARR}.actor.use_dynamic_bsz=false, {MICRO}=8, "
        f"{ARR}.actor.ppo_max_token_len_per_gpu=16384",
        f"  knob: {MICRO} = 8 -> 6 (actor update peaks at 31.8 GiB (limit 72.7 GiB with the margin))",
        f"  paste: {MICRO}=6",
        "  run directory: outputs/run",
    ]


def test_the_real_estimator_fits_a_value_below_the_one_that_ran_out(
    recorded: Callable[[str], dict[str, Any]],
) -> None:
    report = oom_report(recorded("actor_update"), context("hardware.gpu_memory_gb=80"), postmortem.load_fit())
    (advice,) = report.advice
    assert advice.key == MICRO
    assert isinstance(advice.value, int) and 1 <= advice.value < 8
    assert 120 % advice.value == 0  # divides the per-GPU mini batch (60 x 12 / 6)
    assert report.override == f"{MICRO}={advice.value}"


def test_without_the_estimator_the_knob_is_halved_and_the_report_says_so(
    recorded: Callable[[str], dict[str, Any]],
) -> None:
    report = oom_report(recorded("actor_update"), context(), None)
    assert report.override == f"{MICRO}=4"
    assert report.notes == (NO_FIT,)


@pytest.mark.parametrize(
    ("stage", "override"),
    [
        ("weight_sync", f"{ARR}.rollout.gpu_memory_utilization=0.4"),
        (
            "init_model",
            f"{ARR}.actor.fsdp_config.param_offload=true {ARR}.actor.fsdp_config.optimizer_offload=true",
        ),
    ],
)
def test_stages_without_micro_batches_get_their_own_knobs(
    recorded: Callable[[str], dict[str, Any]], stage: str, override: str
) -> None:
    assert oom_report(recorded(stage), context(), postmortem.load_fit()).override == override


def gpu_record(stage: str, status: str, peak: float, used: float) -> dict[str, Any]:
    """A record in the shape a CUDA worker writes."""
    return {
        "stage": stage,
        "status": status,
        "rank": 0,
        "step": 3,
        "time": 1.0,
        "cuda": True,
        "peak_allocated_gib": peak,
        "device_used_gib": used,
        "device_total_gib": 79.1,
        "settings": {MICRO: 8},
        "knobs": [MICRO],
        "error": "OutOfMemoryError: CUDA out of memory" if status == "oom" else None,
    }


def test_estimated_vs_measured_table() -> None:
    records = [gpu_record("old_log_prob", "ok", 20.04, 41.2), gpu_record("actor_update", "ok", 30.0, 52.5)]
    estimated = {"old log-prob": 22.2, "actor update": 33.3}
    assert render_peaks(records, estimated).splitlines() == [
        "stage           estimated GiB torch peak GiB device used GiB",
        "old_log_prob             22.2           20.0            41.2",
        "actor_update             33.3           30.0            52.5",
    ]
    assert (
        render_peaks([], None)
        == "memory: no records were written (the workers never reached a wrapped stage)"
    )


def test_after_a_run_an_oom_record_wins_over_the_ray_error_and_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = json.dumps(gpu_record("actor_update", "oom", 75.2, 79.0))
    (tmp_path / "memory-0.jsonl").write_text(line + "\n")
    plan = SimpleNamespace(run_dir=tmp_path)
    pre = SimpleNamespace(context=context())
    failure = LaunchError("the launch failed: RayTaskError: ...")
    code = after_run(plan, pre, failure, Outcome(json=False))  # type: ignore[arg-type]
    err = capsys.readouterr().err.splitlines()
    assert code == 3
    assert (
        err[0]
        == "error: out of memory in stage actor_update (ActorRolloutRefWorker.update_actor), rank 0, step 3"
    )
    assert err[3] == "  device: 79.0 of 79.1 GiB used, torch peak 75.2 GiB allocated"
    assert err[-2].startswith(f"  paste: {MICRO}=")


def test_a_worker_failure_is_reported_with_the_stage_it_failed_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))

    def fails(self: Worker, *args: Any) -> None:
        raise RuntimeError("Distributed package doesn't have NCCL built in\nmore")

    with pytest.raises(RuntimeError):
        wrap_stage(fails, STAGE_BY_NAME["init_model"])(Worker(), {})
    failure = LaunchError(
        "the launch failed in WorkerDict.actor_rollout_init_model (pid 12, 10.0.0.3): RuntimeError: ...",
        where=f"run directory {tmp_path}",
        fix="look at the run directory",
    )
    plan = SimpleNamespace(run_dir=tmp_path)
    pre = SimpleNamespace(context=context())
    out = Outcome(json=True)
    with pytest.raises(LaunchError) as info:
        after_run(plan, pre, failure, out)  # type: ignore[arg-type]
    record = postmortem.first_failure(read_records(tmp_path))
    assert (
        record is not None
        and record["error"] == "RuntimeError: Distributed package doesn't have NCCL built in"
    )
    assert info.value.exit_code == 3
    assert info.value.render().splitlines() == [
        f"error: {failure.what}",
        f"  where: stage init_model (ActorRolloutRefWorker.init_model), rank 2, pid {os.getpid()} on "
        f"{socket.gethostname()} (no CUDA device); run directory {tmp_path}",
        f"  fix: {NO_CUDA_FIX}",
    ]
    assert out.data["failed_stage"] == "init_model"
    assert postmortem.failure_report(failure, None, tmp_path) is failure  # no record: the error as it was

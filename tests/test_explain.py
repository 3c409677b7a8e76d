"""``explain``: golden walks of the four reference configs, JSON output, and the errors it points to."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
from conftest import EXAMPLES, ROOT, CliResult, check_golden

GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm"]
GOLDEN_CASES = {
    "explain_grpo_6gpu": [
        "-c",
        str(EXAMPLES / "grpo_6gpu.yaml"),
        "hardware.nodes=1",
        "hardware.gpus_per_node=6",
    ],
    "explain_2gpu": [
        *GRPO,
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "hardware.nodes=1",
        "hardware.gpus_per_node=2",
    ],
    "explain_8gpu": [
        *GRPO,
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "data.train_batch_size=48",
        "actor_rollout_ref.rollout.n=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=48",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=6",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "hardware.nodes=1",
        "hardware.gpus_per_node=8",
    ],
    "explain_4x8_ulysses4": [
        *GRPO,
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=4",
        "data.train_batch_size=128",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "hardware.nodes=4",
        "hardware.gpus_per_node=8",
    ],
}


@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_golden_walk(cli: Callable[..., CliResult], name: str) -> None:
    result = cli("explain", *GOLDEN_CASES[name])
    assert result.code == 0, result.err
    check_golden(f"{name}.txt", result.out.replace(str(ROOT) + "/", ""))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "explain_grpo_6gpu",
            {"sequences": 720, "replicas": 3, "sequences_per_replica": 240, "grad_accum": 15},
        ),
        ("explain_2gpu", {"sequences": 128, "mini_per_gpu": 64, "grad_accum": 16}),
        ("explain_8gpu", {"sequences": 576, "replicas": 4, "sequences_per_replica": 144, "mini_per_gpu": 72}),
        (
            "explain_4x8_ulysses4",
            {"dp_actor": 8, "replicas": 16, "mini_per_gpu": 128, "logprob_micro_batches": 32},
        ),
    ],
)
def test_json_walk(cli: Callable[..., CliResult], name: str, expected: dict[str, int]) -> None:
    result = cli("explain", *GOLDEN_CASES[name], "--format", "json")
    data = json.loads(result.out)
    values = {step["id"]: step["value"] for step in data["steps"]}
    assert {k: values[k] for k in expected} == expected
    assert data["errors"] == [] and data["plan"]["gpus"] == values["gpus"]
    assert all(step["keys"] for step in data["steps"] if step["id"] != "padded")


def test_points_to_the_failing_rule(cli: Callable[..., CliResult]) -> None:
    result = cli(
        "explain", *GOLDEN_CASES["explain_8gpu"], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"
    )
    assert result.code == 0
    assert (
        "(grad accumulation)      —  = 72 trajectories / 5 (ppo_micro_batch_size_per_gpu) = 14.4: not a whole"
        in result.out
    )
    assert (
        "error [batch-micro-divides-mini] actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5 does not"
        in result.out
    )


def test_console_script_end_to_end() -> None:
    exe = ROOT / ".venv" / "bin" / "verl-safe-launch"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "verl_safe_launch"]
    proc = subprocess.run(
        [*command, "explain", *GOLDEN_CASES["explain_2gpu"]], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "sequences per step                                  128  = 16 prompts × 8 (rollout.n)" in proc.stdout
    )

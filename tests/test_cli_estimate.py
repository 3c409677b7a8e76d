"""The ``estimate`` verb: the table per stage, JSON, ``--fit`` overrides, and compact user errors."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from conftest import EXAMPLES, CliResult

EXAMPLE = str(EXAMPLES / "grpo_6gpu.yaml")


@pytest.fixture(autouse=True)
def declared_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the hardware.* tokens count (no nvidia-smi or Slurm detection on the test machine)."""
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def test_table_per_stage_with_verdicts(cli: Callable[..., CliResult]) -> None:
    r = cli("estimate", "-c", EXAMPLE, "hardware.gpu_memory_gb=80")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("GPU memory per GPU (GiB) for Qwen/Qwen2.5-7B-Instruct")
    header = lines[2].split()
    assert header[:2] == ["stage", "params"] and header[-3:] == ["total", "band", "verdict"]
    stages = [line.split()[0] for line in lines[3:7]]
    assert stages == ["rollout", "old", "ref", "actor"]
    assert all(line.endswith("fits") for line in lines[3:7])
    assert "assumptions:" in lines


def test_fit_prints_overrides_to_paste(cli: Callable[..., CliResult]) -> None:
    r = cli("estimate", "--fit", "-c", EXAMPLE, "hardware.gpu_memory_gb=80")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    paste = lines[lines.index("paste:") + 1].split()
    assert paste == [
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=120",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=120",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=30",
    ]
    # nothing says whether the GPU nodes have flash-attn: the fit takes verl's other log-prob path, and says so
    assert lines[-1] == (
        "note: these values assume no flash-attn cross-entropy (not known for the GPU nodes); with "
        "hardware.flash_attn=true if the GPU nodes have flash-attn installed (verl then uses its cross-entropy for "
        "log-probs): actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40"
    )
    check = cli("check", "-c", EXAMPLE, "hardware.gpu_memory_gb=80", *paste)
    assert check.code == 0, check.out
    declared = cli(
        "estimate", "--fit", "-c", EXAMPLE, "hardware.gpu_memory_gb=80", "hardware.flash_attn=true"
    )
    assert (
        declared.out.splitlines()[-1].split()[-1] == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40"
    )
    bolder = ["hardware.flash_attn=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40"]
    assert cli("check", "-c", EXAMPLE, "hardware.gpu_memory_gb=80", *bolder).code == 0


def test_json(cli: Callable[..., CliResult]) -> None:
    r = cli("estimate", "--fit", "--format", "json", "-c", EXAMPLE, "hardware.gpu_memory_gb=80")
    data = json.loads(r.out)
    assert set(data) == {
        "schema",
        "verl",
        "model",
        "gpu_memory_gib",
        "margin",
        "stages",
        "rollout",
        "assumptions",
        "findings",
        "fit",
        "host",
    }
    update = data["stages"][3]
    assert update["name"] == "actor update" and update["verdict"] == "fits"
    assert set(update["components_gib"]) >= {"parameters", "gradients", "optimizer", "activations"}
    assert data["fit"][2]["override"] == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=30"


def test_margin_out_of_range_is_a_usage_error(cli: Callable[..., CliResult]) -> None:
    r = cli("estimate", "--margin", "1.5", "-c", EXAMPLE)
    assert r.code == 2
    assert r.err == "error: --margin 1.5 is outside [0, 1)\n  where: --margin\n  fix: e.g. --margin 0.1\n"


def test_unknown_model_says_which_key_to_set(cli: Callable[..., CliResult]) -> None:
    r = cli("estimate", "-c", EXAMPLE, "actor_rollout_ref.model.path=/nowhere/model")
    assert r.code == 2
    assert r.err.startswith("error: no architecture for actor model '/nowhere/model'")
    assert "fix: set actor_rollout_ref.model.path to a local model directory" in r.err


def test_check_reports_the_rollout_kv_error_when_the_gpu_is_known(cli: Callable[..., CliResult]) -> None:
    args = [
        "-c",
        EXAMPLE,
        "actor_rollout_ref.model.path=meta-llama/Llama-3.1-8B-Instruct",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
    ]
    r = cli("check", *args, "hardware.gpu_memory_gb=80")
    assert r.code == 1 and "error [rollout-kv-below-max-model-len]" in r.out
    fixed = cli("check", *args, "hardware.gpu_memory_gb=80", "actor_rollout_ref.rollout.max_model_len=1536")
    assert fixed.code == 0 and "rollout-kv-below-max-model-len" not in fixed.out
    unknown = cli("check", *args)
    assert "rollout-kv" not in unknown.out  # no GPU size, no memory verdicts

"""Older releases composed and typed as they are: their own config names, their own YAML's types.

The oracle is the release's own Hydra config directory, composed with Hydra's compose API, and its own code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from conftest import CliResult
from omegaconf import OmegaConf

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, choose_verl, cli_tokens

pytestmark = pytest.mark.slow
LINES = ["data.train_batch_size=64", "trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.name=vllm"]


@pytest.fixture(autouse=True)
def _installed() -> Iterator[None]:
    yield
    choose_verl(None)


def _hydra(release: Path, name: str, lines: list[str]) -> object:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(release / "verl" / "trainer" / "config"), version_base=None):
        cfg = hydra_compose(name, overrides=lines)
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.mark.parametrize("version", ["0.5.0", "0.6.1", "0.7.1"])
def test_ppo_megatron_trainer_is_the_releases_own_config(releases: Path, version: str) -> None:
    """0.5 to 0.7 ship ppo_megatron_trainer as a config of its own (no model_engine group to choose)."""
    choose_verl(releases / version, "--verl")
    ours = compose(ComposeRequest(overrides=cli_tokens(LINES), config_name="ppo_megatron_trainer"))
    mine = yaml.safe_load(OmegaConf.to_yaml(ours.cfg, resolve=False))
    assert mine == _hydra(releases / version, "ppo_megatron_trainer", LINES)
    assert mine["actor_rollout_ref"]["actor"]["strategy"] == "megatron"


def test_top_p_is_a_number_in_0_5_0(releases: Path, cli: Callable[..., CliResult]) -> None:
    """0.5.0 writes ``top_p: 1`` for the rollout and ``top_p: 1.0`` for validation: 1.0 is no type error there."""
    line = [*LINES, "actor_rollout_ref.rollout.top_p=1.0", "--format", "json"]
    data = json.loads(cli("--verl", str(releases / "0.5.0"), "check", *line).out)
    assert not [f for f in data["findings"] if f["rule_id"] == "type-mismatch"]
    rollout = yaml.safe_load((releases / "0.5.0" / "verl/trainer/config/rollout/rollout.yaml").read_text())
    assert (rollout["top_p"], rollout["val_kwargs"]["top_p"]) == (1, 1.0)


def test_0_5_0_computes_the_megatron_minimal_batch_even_with_dynamic_batch_size(
    releases: Path, cli: Callable[..., CliResult]
) -> None:
    """Its _validate_config multiplies ppo_micro_batch_size_per_gpu in without an ``if`` on use_dynamic_bsz:
    unset, verl 0.5.0 raises a TypeError there (0.9.1 skips the check); the release's own method is the oracle."""
    line = [
        *LINES,
        "--config-name",
        "ppo_megatron_trainer",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "--format",
        "json",
    ]
    data = json.loads(cli("--verl", str(releases / "0.5.0"), "check", *line).out)
    found = [f for f in data["findings"] if f["rule_id"] == "batch-megatron-train-divisible"]
    assert [f["severity"] for f in found] == ["error"]
    assert "verl 0.5.0 stops here in RayPPOTrainer._validate_config" in found[0]["message"]
    choose_verl(None)  # the in-process CLI keeps --verl for the process, as one command would
    installed = json.loads(cli("check", *line).out)
    assert not [f for f in installed["findings"] if f["rule_id"] == "batch-megatron-train-divisible"]
    choose_verl(releases / "0.5.0", "--verl")
    request = ComposeRequest(overrides=cli_tokens([*LINES, line[-3]]), config_name="ppo_megatron_trainer")
    config = OmegaConf.to_container(compose(request).cfg, resolve=False)
    env = {**os.environ, "PYTHONPATH": str(releases / "0.5.0")}
    oracle = [sys.executable, str(Path(__file__).parent / "release_oracle.py")]
    done = subprocess.run(
        oracle, input=json.dumps([config]), env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [verdict] = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict is not None and verdict.startswith("TypeError: unsupported operand type(s) for *")

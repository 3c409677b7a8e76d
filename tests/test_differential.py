"""Differential test against the installed verl: whenever verl's validate_config rejects a config, so do we.

A short run (40 generated configs); bench/differential.py runs 500 and prints the counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import examples, make_tiny_model
from hypothesis import HealthCheck, Phase, given, settings
from verl_oracle import Tally, configs, judge, verl_verdict, with_models

from verl_safe_launch.context import HardwareFacts

pytestmark = pytest.mark.slow
TALLY = Tally()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("differential") / "tiny-model")


def test_tiny_model_loads_in_verls_critic_path(model: Path) -> None:
    from recompose import recompose

    valid = [
        "actor_rollout_ref.rollout.name=vllm",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    assert verl_verdict(recompose(with_models(valid, model)).cfg) is None


@settings(
    max_examples=examples(40),
    deadline=None,
    phases=[Phase.generate, Phase.shrink],
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(overrides=configs())
def test_we_reject_whatever_verl_rejects(model: Path, overrides: list[str]) -> None:
    verl, ours = judge(overrides, model, HardwareFacts(), TALLY)
    assert verl is None or ours, f"verl rejects ({verl}) but no rule does: {overrides}"

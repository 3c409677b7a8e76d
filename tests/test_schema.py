"""verl's config schema, generated from its dataclasses: unions, open dict fields, dataclass-backed nodes."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens, key_facts, verl_config_dir
from verl_safe_launch.inputs.schema import SCHEMA_FILE, generate_schema, load_schema

ARR = "actor_rollout_ref"


def test_schema_knows_unions_open_dicts_and_nested_dataclasses() -> None:
    schema = load_schema()
    threshold = schema["verl.trainer.config.algorithm.RolloutCorrectionConfig"]["rollout_is_threshold"]
    assert (threshold.kinds, threshold.text) == (("float", "str"), "float | str")
    assert schema["verl.workers.config.DistillationConfig"]["teacher_models"].open
    policy = schema["verl.workers.config.PolicyLossConfig"]
    assert "tau_pos" not in policy and "loss_mode" in policy


def test_facts_use_the_schema() -> None:
    composed = compose(ComposeRequest(overrides=cli_tokens(["model_engine=megatron"])))
    facts = key_facts(composed.writes)
    assert "algorithm.rollout_correction.rollout_is_threshold" not in facts.types  # a union: not checked
    assert facts.free_form_parent(f"{ARR}.actor.megatron.override_transformer_config.x") is not None
    assert str(facts.backing_class(f"{ARR}.actor.policy_loss")).endswith(".PolicyLossConfig")


@pytest.mark.slow
def test_schema_file_equals_a_fresh_generation() -> None:
    """Regenerate from the installed verl: the shipped data file must be what its dataclasses say."""
    shipped = json.loads(resources.files("verl_safe_launch.data").joinpath(SCHEMA_FILE).read_text())
    fresh = json.loads(json.dumps(generate_schema(verl_config_dir())))
    assert fresh == shipped, "regenerate: python -c 'see verl_safe_launch/inputs/schema.py generate_schema'"

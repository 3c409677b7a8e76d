"""Model rules: a local model's config.json must name exactly one architecture (verl's HFModelConfig asserts it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_tiny_model

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import rule_context
from verl_safe_launch.rules.model import one_architecture

ARR = "actor_rollout_ref"


@pytest.mark.parametrize(("architectures", "errors"), [(["Qwen2ForCausalLM"], 0), (["A", "B"], 1), ([], 1)])
def test_exactly_one_architecture(tmp_path: Path, architectures: list[str], errors: int) -> None:
    model = make_tiny_model(tmp_path / "m", architectures=architectures)
    composed = compose(ComposeRequest(overrides=cli_tokens([f"{ARR}.model.path={model}"])))
    found = one_architecture(rule_context(composed))
    assert len(found) == errors
    if errors:
        assert f"lists {len(architectures)} architectures" in found[0].message


def test_hub_names_are_not_judged() -> None:
    composed = compose(ComposeRequest(overrides=cli_tokens([f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct"])))
    assert one_architecture(rule_context(composed)) == []

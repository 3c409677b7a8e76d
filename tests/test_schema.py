"""verl's config schema, generated from its dataclasses: unions, open dict fields, dataclass-backed nodes.

Read from source (``schema_ast``) for any verl other than the one the shipped file came from.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import (
    ComposeRequest,
    choose_verl,
    cli_tokens,
    key_facts,
    verl_config_dir,
    verl_package_dir,
)
from verl_safe_launch.inputs.schema import (
    SCHEMA_FILE,
    generate_schema,
    is_shipped_verl,
    load_schema,
    ship_schema,
    shipped_schema,
)
from verl_safe_launch.inputs.schema_ast import read_schema

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
    fresh = json.loads(json.dumps(ship_schema(verl_package_dir())))
    assert fresh == shipped, "regenerate: see verl_safe_launch/inputs/schema.py ship_schema"


@pytest.mark.slow
def test_static_reader_equals_the_import_based_generation() -> None:
    """Reading verl's source with ``ast`` says exactly what importing its dataclasses says."""
    oracle = json.loads(json.dumps(generate_schema(verl_config_dir())))
    assert read_schema(verl_package_dir()) == oracle


def test_static_reader_equals_the_shipped_file() -> None:
    shipped = shipped_schema()
    static = read_schema(verl_package_dir())
    assert static == {"verl_version": shipped["verl_version"], "classes": shipped["classes"]}


def test_shipped_file_is_used_only_for_the_verl_it_came_from() -> None:
    shipped = shipped_schema()
    assert is_shipped_verl(verl_package_dir(), shipped)
    altered = {**shipped, "source": {**shipped["source"], "files": shipped["source"]["files"][:-1]}}
    assert not is_shipped_verl(verl_package_dir(), altered)
    assert not is_shipped_verl(verl_package_dir(), {**shipped, "verl_version": "0.9.0"})


FORK = """
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from omegaconf import MISSING

from verl.base import Base


@dataclass
class PolicyConfig(Base):
    _hidden: int = 0
    kind: ClassVar[str] = "x"
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    clip: "float | None" = 0.2
    extra: dict[str, Any] = field(default_factory=dict)
    steps: Optional[int] = field(default=2**10)
    name: str = MISSING
    not_a_field = 3
"""


def test_a_forks_schema_is_read_from_its_source(tmp_path: Path) -> None:
    """A verl that is not the shipped one: its dataclasses read statically, nothing of it imported."""
    package = tmp_path / "verl"
    (package / "version").mkdir(parents=True)
    (package / "trainer" / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('a fork that must not be imported')\n")
    (package / "version" / "version").write_text("0.9.1\n")
    (package / "base.py").write_text(
        "from dataclasses import dataclass\n@dataclass\nclass Base:\n    seed: int = 1\n"
    )
    (package / "policy.py").write_text(FORK)
    (package / "trainer" / "config" / "ppo_trainer.yaml").write_text(
        "policy:\n  _target_: verl.policy.PolicyConfig\n  loss_mode: vanilla\n"
    )
    choose_verl(tmp_path, "--verl")
    try:
        fields = load_schema()["verl.policy.PolicyConfig"]
    finally:
        choose_verl(None)
    assert sorted(fields) == ["clip", "extra", "loss_mode", "name", "seed", "steps"]
    assert (fields["loss_mode"].text, fields["loss_mode"].default) == ("str", '"vanilla"')
    assert (fields["clip"].text, fields["steps"].default) == ("float | None", "1024")
    assert fields["extra"].open and fields["extra"].default == "(factory)"
    assert fields["name"].default == '"???"' and fields["seed"].default == "1"
    assert "verl.workers.config.ActorConfig" in load_schema()  # the installed verl's again

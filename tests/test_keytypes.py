"""What verl's schema says about each key, checked against verl's composed config (the dataclass side is
generated from verl's real dataclasses and checked in test_schema.py)."""

from __future__ import annotations

import pytest

from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens, key_facts, verl_files, verl_prefix
from verl_safe_launch.provenance import Layer

SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def composed(*overrides: str) -> Composed:
    return compose(ComposeRequest(overrides=cli_tokens(list(overrides))))


@pytest.fixture(scope="module")
def base() -> Composed:
    return composed()


def test_verl_writes_come_first_and_name_the_files(base: Composed) -> None:
    mine = composed("data.train_batch_size=7")
    count = verl_prefix(mine.writes)
    assert count > 0 and all(w.source.layer is Layer.VERL for w in mine.writes[:count])
    assert all(w.source.layer is not Layer.VERL for w in mine.writes[count:])
    assert verl_files(mine.writes) == verl_files(base.writes)
    assert verl_files(composed("model_engine=megatron").writes) != verl_files(base.writes)
    assert verl_files(()) == ()


def test_facts_are_cached_per_verl_composition(base: Composed) -> None:
    assert key_facts(composed("trainer.nnodes=3").writes) is key_facts(base.writes)
    assert key_facts(composed("model_engine=megatron").writes) is not key_facts(base.writes)


def test_defaults_are_verl_s_values(base: Composed) -> None:
    from omegaconf import OmegaConf

    facts = key_facts(base.writes)
    assert facts.mandatory
    for key in facts.mandatory:
        parent, _, leaf = key.rpartition(".")
        assert OmegaConf.is_missing(OmegaConf.select(base.cfg, parent), leaf), key
    values = base.view.values
    same = [k for k, v in facts.defaults.items() if k in values and not isinstance(v, (dict, list, str))]
    assert len(same) > 300
    assert all(facts.defaults[k] == values[k] for k in same)


def test_every_type_agrees_with_verl_s_default(base: Composed) -> None:
    facts = key_facts(base.writes)
    python = {"int": int, "float": (int, float), "bool": bool, "list": list}
    checked = 0
    for key, spec in facts.types.items():
        default = facts.defaults[key]
        if spec.kind not in python or default is None or isinstance(default, str):
            continue
        assert isinstance(default, python[spec.kind]), (key, spec, default)
        assert spec.kind == "bool" or not isinstance(default, bool), key
        checked += 1
    assert checked > 200


def test_known_keys_and_free_form_sections(base: Composed) -> None:
    facts = key_facts(base.writes)
    yaml_key = next(k for k in facts.defaults if k.endswith(".ppo_mini_batch_size"))
    dc_key = next(iter(facts.dc_only))
    assert facts.known(yaml_key) and facts.known(dc_key)
    assert not facts.known(yaml_key + "_typo")
    empty = next(k for k, v in facts.defaults.items() if v == {})
    assert facts.free_form_parent(f"{empty}.anything.below") == empty
    section = yaml_key.rsplit(".", 1)[0]
    assert facts.free_form_parent(f"{section}.not_a_key") is None

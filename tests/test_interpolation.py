"""The flat interpolation resolver against OmegaConf's own resolution of the same config."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf

from verl_safe_launch.compose import Resolver, compose
from verl_safe_launch.compose.interpolation import Unsupported
from verl_safe_launch.inputs import ComposeRequest, cli_tokens

CONFIG: dict[str, Any] = {
    "model": {"path": "Qwen/Qwen2.5-7B", "hidden": 64, "ratio": 0.5, "flag": True, "none": None},
    "data": {"batch": 32, "missing": "???", "empty": {}},
    "actor": {
        "batch": "${data.batch}",
        "path": "${model.path}",
        "sibling": "${.batch}",
        "parent": "${..model.hidden}",
        "text": "p=${model.path}, b=${data.batch}!",
        "chain": "${actor.sibling}",
        "whole": "${model}",
        "select": "${oc.select:model.hidden,7}",
        "select_absent": "${oc.select:model.nope,7}",
        "select_null": "${oc.select:model.nope,null}",
        "select_none": "${oc.select:model.nope}",
        "select_float": "${oc.select:model.nope,0.25}",
        "select_bool": "${oc.select:model.nope,false}",
        "select_word": "${oc.select:model.nope,fsdp}",
        "select_nested": "${oc.select:model.nope,${data.batch}}",
        "select_missing": "${oc.select:data.missing,3}",
        "select_relative": "${oc.select:.batch,1}",
        "select_empty_dict": "${oc.select:model.nope,{}}",
        "plain": 5,
    },
}


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= flat(value, full + ".")
        else:
            out[full] = value
    return out


RAW = flat(CONFIG)


def leaves(prefix: str) -> list[str]:
    return [k for k in RAW if k.startswith(prefix + ".")]


RESOLVER = Resolver(RAW, leaves)
EXPECTED = OmegaConf.to_container(OmegaConf.create(CONFIG), resolve=True, throw_on_missing=False)


def omegaconf_value(key: str) -> Any:
    node: Any = EXPECTED
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("key", [k for k in RAW if k.startswith("actor.")])
def test_value_equals_omegaconf(key: str) -> None:
    value = RESOLVER.value(key)
    expected = omegaconf_value(key)
    assert (value, type(value)) == (expected, type(expected))


@pytest.mark.parametrize(
    "text",
    [
        "${oc.env:HOME}",  # other resolvers
        "${oc.select:model.nope,'quoted'}",
        "${oc.select:model.nope,inf}",  # OmegaConf makes a float of it; the resolver leaves it to OmegaConf
        "${data.missing}",  # a mandatory value nobody set
        "${model.nope}",  # a key that does not exist
        "${model.path}\\${escaped}",
        "${unclosed",
    ],
)
def test_what_it_does_not_model_is_unsupported(text: str) -> None:
    resolver = Resolver({**RAW, "x.y": text}, leaves)
    with pytest.raises(Unsupported):
        resolver.value("x.y")


def test_a_cycle_is_unsupported_not_endless() -> None:
    raw = {"a.x": "${b.x}", "b.x": "${a.x}"}
    with pytest.raises(Unsupported):
        Resolver(raw, lambda prefix: [k for k in raw if k.startswith(prefix + ".")]).value("a.x")


@pytest.mark.parametrize("engine", ["dp", "megatron"])
def test_every_interpolation_of_verl_s_defaults(engine: str) -> None:
    """verl's composed config, flattened unresolved: each interpolation resolves to OmegaConf's value."""
    composed = compose(ComposeRequest(overrides=cli_tokens([f"model_engine={engine}"])))
    raw = flat(OmegaConf.to_container(composed.cfg, resolve=False))  # type: ignore[arg-type]
    resolver = Resolver(raw, lambda prefix: [k for k in raw if k.startswith(prefix + ".")])
    refs = [k for k, v in raw.items() if isinstance(v, str) and "${" in v]
    assert len(refs) > 100
    for key in refs:
        expected = composed.view.values[key]
        value = resolver.value(key)
        assert (value, type(value)) == (expected, type(expected)), key

"""The fast overlay equals a full composition: values, order, provenance, writes and rejected overrides."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA, examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from verl_safe_launch.compose import Composed, Overlay, Resolver, compose
from verl_safe_launch.compose.overlay import parse_value
from verl_safe_launch.config_view import flatten
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.shell import ScriptLaunch, read_script

OVERLAY = Overlay()
ARR = "actor_rollout_ref"
LAUNCHES = [launch for path in sorted((DATA / "scripts").glob("*.sh")) for launch in read_script(path)]


def assert_same(full: Composed, fast: Composed) -> None:
    assert list(fast.view.values.items()) == list(full.view.values.items())
    assert dict(fast.view.provenance) == dict(full.view.provenance)
    assert fast.writes == full.writes
    assert fast.rejected == full.rejected
    assert fast.verl_overrides == full.verl_overrides


@pytest.mark.parametrize("launch", LAUNCHES, ids=[launch.label.rsplit("/", 1)[-1] for launch in LAUNCHES])
def test_overlay_equals_compose_on_every_fixture(launch: ScriptLaunch) -> None:
    before = OVERLAY.fast
    assert_same(compose(launch.request()), OVERLAY.compose(launch.request()))
    assert OVERLAY.fast == before + 1, "the fixtures use only what the fast path models"


POOL = [
    f"{ARR}.actor.use_dynamic_bsz=true",
    f"{ARR}.actor.ppo_max_token_len_per_gpu=9000",
    f"{ARR}.actor.ppo_mini_batch_size=32",
    f"{ARR}.actor.ulysses_sequence_parallel_size=2",
    "critic.ppo_micro_batch_size=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "data.max_prompt_length=2048",
    "data.train_batch_size=abc",
    "trainer.project_name=p1",
    "trainer.logger=[console]",
    "data.train_bach_size=1",
    "+data.train_batch_size=1",
    f"+{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4",
    f"+{ARR}.rollout.name=vllm",
    "+trainer.logger=[console,wandb]",
    "+trainer.new_flag=1",
    "++trainer.other.flag=true",
    f"+{ARR}.actor.megatron.seed=7",
    f"++{ARR}.actor.ppo_infer_max_token_len_per_gpu=1234",
    "model_engine=megatron",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=2",
    f"{ARR}.rollout.gpu_memory_utilization=0.7",
    "trainer.nnodes=2",
    "trainer.nnodes=3",
    f"+{ARR}.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_AND_PIECEWISE",  # under {}
    f"++{ARR}.rollout.engine_kwargs.vllm.max_model_len=8192",
    f"{ARR}.rollout.engine_kwargs.vllm.swap_space=4",  # plain: refused
    f"+{ARR}.actor.optim.override_optimizer_config.optimizer_offload_fraction=1",  # under null
    "+data.apply_chat_template_kwargs.enable_thinking=True",
]


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(POOL), min_size=1, max_size=7))
def test_overlay_equals_compose_on_random_override_lists(overrides: list[str]) -> None:
    request = ComposeRequest(overrides=cli_tokens(overrides), lenient=True)
    assert_same(compose(request), OVERLAY.compose(request))


PLUS = [
    (f"+{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4", True),  # null in verl's YAML
    (f"+{ARR}.rollout.name=vllm", True),  # '???'
    ("+trainer.logger=[console,wandb]", True),  # a list merges
    ("+data.train_batch_size=1", False),
    (f"++{ARR}.rollout.n=2", True),
    ("+trainer.brand_new=1", True),
    (f"+{ARR}.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL", True),  # opens an empty {}
    (f"+{ARR}.actor.optim.override_optimizer_config.optimizer_offload_fraction=1", True),  # opens a null
]


@pytest.mark.parametrize(("text", "accepted"), PLUS)
def test_plus_follows_hydra_on_every_path(text: str, accepted: bool) -> None:
    """Hydra itself, the full composition and the overlay make the same '+'/'++' decision."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException

    request = ComposeRequest(overrides=cli_tokens([text]), lenient=True)
    full, fast = compose(request), OVERLAY.compose(request)
    assert_same(full, fast)
    assert (not full.rejected) is accepted
    cfg = compose(ComposeRequest(overrides=())).cfg
    try:
        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides([text]), cfg)
        hydra_accepts = True
    except ConfigCompositionException:
        hydra_accepts = False
    assert hydra_accepts is accepted


def test_strict_rejection_falls_back_to_the_exact_error() -> None:
    from verl_safe_launch.errors import UsageError

    request = ComposeRequest(overrides=cli_tokens(["data.train_bach_size=1"]))
    with pytest.raises(UsageError) as caught:
        OVERLAY.compose(request)
    assert caught.value.what == "unknown key 'data.train_bach_size': verl's config has no such key"


def test_files_and_presets_take_the_full_path(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 8\n")
    overlay = Overlay()
    overlay.compose(ComposeRequest(config_files=(path,)))
    assert (overlay.fast, overlay.full) == (0, 1)


@pytest.mark.parametrize("engine", ["dp", "megatron", "veomni", "torchtitan"])
def test_interpolation_resolver_matches_omegaconf(engine: str) -> None:
    from omegaconf import OmegaConf

    cfg = compose(ComposeRequest(overrides=cli_tokens([f"model_engine={engine}"]))).cfg
    raw = flatten(OmegaConf.to_container(cfg, resolve=False))  # type: ignore[arg-type]
    resolved = OmegaConf.to_container(cfg, resolve=True)

    def leaves(prefix: str) -> list[str]:
        return [k for k in raw if k.startswith(prefix + ".")]

    resolver = Resolver(raw, leaves)
    interpolated = [k for k, v in raw.items() if isinstance(v, str) and "${" in v]
    assert len(interpolated) > 100
    for key in interpolated:
        expected: Any = resolved
        for part in key.split("."):
            expected = expected[part]
        value = resolver.value(key)
        assert (value, type(value)) == (expected, type(expected)), key


def _hydra_value(text: str) -> tuple[bool, object]:
    """Hydra's own parser on ``k=<text>``: (True, value) for a plain literal, else (False, None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_override(f"k={text}")
    except HydraException:
        return False, None
    value = override.value()
    if override.value_type is not ValueType.ELEMENT or isinstance(value, dict):
        return False, None
    if isinstance(value, str) and "${" in value:
        return False, None
    return True, value


def _same(a: object, b: object) -> bool:
    """Equal values of the same type, where NaN equals NaN (``nan == nan`` is false in Python)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return type(a) is type(b)
    return a == b and type(a) is type(b)


@settings(max_examples=examples(400), deadline=None)
@given(st.text(alphabet="abeEfinlrstu019_-./+ ", max_size=10))
@example("nan")  # found once: NaN compared unequal to itself
@example("-nan")
@example("+inf")
@example("1e5")
@example("1_0")
def test_fast_value_parser_agrees_with_hydra(text: str) -> None:
    fast = parse_value(text)
    hydra = _hydra_value(text)
    assert fast[0] == hydra[0] and _same(fast[1], hydra[1])


@pytest.mark.parametrize(
    "launch", LAUNCHES[:4], ids=[launch.label.rsplit("/", 1)[-1] for launch in LAUNCHES[:4]]
)
@pytest.mark.parametrize(
    "extra",
    [
        [f"{ARR}.rollout.max_num_seqs=1024"],
        ["trainer.use_v1=false", "data.no_such_key=1"],
        [f"{ARR}.actor.ulysses_sequence_parallel_size=2"],
        ["+trainer.new_flag=1"],
    ],
)
def test_extending_a_composition_equals_composing_it_again(launch: ScriptLaunch, extra: list[str]) -> None:
    """``extend`` lays overrides over a full composition (as the upgrade judges each advice line alone)."""
    request = launch.request()
    overlay = Overlay()
    base = compose(request)
    tokens = cli_tokens(extra)
    again = compose(replace(request, overrides=(*request.overrides, *tokens)))
    assert_same(again, overlay.extend(base, request, tokens))
    assert overlay.fast == 1

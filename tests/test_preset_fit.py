"""An adapted preset is GO under the pre-flight, or the report says why no adaptation fits (preset-cannot-fit)."""

from __future__ import annotations

import os

import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.inputs.architecture import bundled_table
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.presets import compose_for_launch

ARR = "actor_rollout_ref"
MODELS = sorted(bundled_table())
EXAMPLES = int(os.environ.get("VSL_PRESET_EXAMPLES", "20"))


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def _errors(*tokens: str) -> dict[str, str]:
    preflight = run_preflight(compose_for_launch(ComposeRequest(overrides=cli_tokens(list(tokens)))))
    return {f.rule_id: f.message for f in preflight.findings if f.severity is Severity.ERROR}


@settings(
    max_examples=examples(EXAMPLES),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    preset=st.sampled_from(["auto", "small", "medium", "cluster"]),
    model=st.sampled_from(MODELS),
    gpus=st.integers(1, 8),
    nodes=st.integers(1, 8),
    memory=st.integers(16, 141),
)
def test_adapted_preset_is_go_or_says_it_cannot_fit(
    preset: str, model: str, gpus: int, nodes: int, memory: int
) -> None:
    errors = _errors(
        f"preset={preset}",
        f"{ARR}.model.path={model}",
        f"hardware.gpus_per_node={gpus}",
        f"hardware.nodes={nodes}",
        f"hardware.gpu_memory_gb={memory}",
    )
    assert not errors or "preset-cannot-fit" in errors, errors


@pytest.mark.parametrize(
    ("preset", "model", "gpus", "nodes"),
    [
        ("medium", "Qwen/Qwen2.5-14B-Instruct", 8, 1),
        ("medium", "Qwen/Qwen2.5-14B-Instruct", 6, 1),
        ("small", "Qwen/Qwen2.5-7B-Instruct", 2, 1),
        ("cluster", "Qwen/Qwen2.5-72B-Instruct", 8, 4),
    ],
)
def test_presets_are_go_on_their_intended_hardware(preset: str, model: str, gpus: int, nodes: int) -> None:
    tokens = (f"hardware.gpus_per_node={gpus}", f"hardware.nodes={nodes}", "hardware.gpu_memory_gb=80")
    assert _errors(f"preset={preset}", f"{ARR}.model.path={model}", *tokens) == {}


def test_cannot_fit_says_the_weights_alone_exceed_the_gpu() -> None:
    errors = _errors(
        "preset=auto",
        f"{ARR}.model.path=Qwen/Qwen2.5-32B-Instruct",
        "hardware.gpus_per_node=1",
        "hardware.gpu_memory_gb=24",
    )
    assert "weights alone need 61.0 GiB per GPU" in errors["preset-cannot-fit"]


MICRO_KEYS = (
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu",
)
GAE_RUN = (
    f"{ARR}.rollout.name=vllm",
    f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct",
    "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "hardware.gpus_per_node=8",
    "hardware.gpu_memory_gb=80",
    "data.train_batch_size=64",
    f"{ARR}.actor.ppo_mini_batch_size=32",
)


def test_check_fit_fills_every_unset_micro_batch_and_judges_on_them() -> None:
    request = ComposeRequest(overrides=cli_tokens([*GAE_RUN, "algorithm.adv_estimator=gae"]))
    unset = run_preflight(compose_for_launch(request))
    ids = {f.rule_id for f in unset.findings if f.severity is Severity.ERROR}
    assert {"verl-actor-micro-keys", "verl-rollout-logprob-micro-keys", "verl-critic-micro-keys"} <= ids
    fitted = run_preflight(compose_for_launch(request, fit=True))
    assert fitted.ok, [f.message for f in fitted.findings if f.severity is Severity.ERROR]
    view = fitted.composed.view
    for key in MICRO_KEYS:
        prov = view.prov(key)
        assert prov is not None and (prov.source.reason or "").startswith("--fit: unset; "), key
    # check's fix names the same maximum that --fit set
    fix = next(f.fix for f in unset.findings if f.rule_id == "verl-rollout-logprob-micro-keys")
    assert fix is not None and f"the memory fit allows up to {view.get(MICRO_KEYS[1])} " in fix


def test_gae_by_default_without_a_critic_model_hints_grpo() -> None:
    tokens = [t for t in GAE_RUN if not t.startswith("critic.")]
    preflight = run_preflight(compose_for_launch(ComposeRequest(overrides=cli_tokens(tokens))))
    critic = next(f for f in preflight.findings if f.rule_id == "verl-critic-micro-keys")
    assert "did you mean `algorithm.adv_estimator=grpo`?" in critic.message
    assert critic.fix is not None and critic.fix.startswith(
        "algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=5; or "
    )  # GRPO needs a group: the hint is re-checked as a whole
    chosen = run_preflight(
        compose_for_launch(ComposeRequest(overrides=cli_tokens([*tokens, "algorithm.adv_estimator=gae"])))
    )
    assert all("did you mean" not in f.message for f in chosen.findings)

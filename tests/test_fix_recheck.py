"""Every fix shown, pasted onto the command line and composed again by Hydra, removes its problem and raises no
new one at least as severe; a fix never repeats the value already set."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from verl_safe_launch.compose import Composed
from verl_safe_launch.findings import SEVERITY_ORDER, Finding, Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.preflight.recheck import fix_changes
from verl_safe_launch.presets import compose_for_launch

SHOWN = (Severity.ERROR, Severity.WARNING)
MODEL = "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture(autouse=True)
def _declared_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def launch_compose(overrides: list[str]) -> Composed:
    """As ``check`` composes: presets adapted to the declared hardware."""
    return compose_for_launch(ComposeRequest(overrides=cli_tokens(list(overrides))))


def preflight(overrides: list[str]) -> tuple[Finding, ...]:
    return run_preflight(launch_compose(overrides)).findings


def shown_fixes(findings: tuple[Finding, ...], overrides: list[str]) -> list[tuple[Finding, list[str]]]:
    """(finding, tokens) for every alternative of every shown fix that sets plain config values."""
    from verl_safe_launch.preflight import rule_context

    ctx = rule_context(launch_compose(overrides))
    out = []
    for finding in findings:
        if finding.severity not in SHOWN or not finding.fix:
            continue
        for alternative in finding.fix.split("; or "):
            if fix_changes(alternative, ctx) is not None:
                out.append((finding, alternative.split(" (")[0].split(";")[0].split()))
    return out


def assert_fix_holds(overrides: list[str], finding: Finding, tokens: list[str]) -> None:
    before = preflight(overrides)
    known = {(f.rule_id, f.keys) for f in before if f.severity in SHOWN}
    composed = launch_compose(overrides)
    assert any(composed.view.get(t.split("=")[0]) != launch_compose([*overrides, t]).view.get(t.split("=")[0])
               for t in tokens), f"{tokens} repeats the value already set"  # fmt: skip
    rank = SEVERITY_ORDER[finding.severity]
    keys = {t.split("=")[0] for t in tokens}
    edited = [o for o in overrides if o.split("=")[0] not in keys]  # the user edits the value in place
    for found in preflight([*edited, *tokens]):
        if found.severity not in SHOWN or SEVERITY_ORDER[found.severity] > rank:
            continue
        ident = (found.rule_id, found.keys)
        assert ident != (finding.rule_id, finding.keys), f"{tokens} leaves {finding.rule_id} in place"
        assert ident in known, f"{tokens} for {finding.rule_id} raises {found.rule_id}: {found.message}"


def test_the_kv_cache_fix_on_24_gb_does_not_make_the_rollout_tight() -> None:
    overrides = ["preset=medium", "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=24", MODEL]
    findings = preflight(overrides)
    [kv] = [f for f in findings if f.rule_id == "rollout-kv-concurrency"]
    assert "gpu_memory_utilization=0.9" not in (kv.fix or ""), "0.9 makes the rollout stage tight"
    tight = preflight([*overrides, "actor_rollout_ref.rollout.gpu_memory_utilization=0.9"])
    assert any(f.rule_id == "memory-stage-tight" for f in tight), "the oracle: 0.9 is tight on 24 GB"
    for finding, tokens in shown_fixes(findings, overrides):
        assert_fix_holds(overrides, finding, tokens)


def test_an_offloaded_actor_is_not_told_to_offload() -> None:
    overrides = [
        "preset=medium",
        "hardware.gpus_per_node=8",
        "hardware.gpu_memory_gb=24",
        MODEL,
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
    ]
    policy = "actor_rollout_ref.actor.fsdp_config.offload_policy"
    assert launch_compose(overrides).view.get(policy) is True, (
        "the preset adapted to 24 GB offloads the actor"
    )
    [tight] = [f for f in preflight(overrides) if f.rule_id == "memory-stage-tight"]
    assert tight.fix == "lower actor_rollout_ref.rollout.gpu_memory_utilization"


CONFIGS = st.fixed_dictionaries(
    {
        "hardware.gpu_memory_gb": st.sampled_from([24, 40, 80]),
        "trainer.n_gpus_per_node": st.sampled_from([2, 4, 8]),
        "hardware.gpus_per_node": st.sampled_from([2, 4, 8]),
        "data.train_batch_size": st.sampled_from([8, 16, 24, 48, 50]),
        "actor_rollout_ref.rollout.n": st.sampled_from([1, 4, 5, 8]),
        "actor_rollout_ref.actor.ppo_mini_batch_size": st.sampled_from([4, 8, 16, 12]),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": st.sampled_from([1, 2, 4, 16]),
        "actor_rollout_ref.rollout.gpu_memory_utilization": st.sampled_from([0.3, 0.5, 0.7, 0.9]),
        "actor_rollout_ref.rollout.tensor_model_parallel_size": st.sampled_from([1, 2, 4]),
        "actor_rollout_ref.actor.fsdp_config.param_offload": st.booleans(),
    }
)


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    derandomize=True,
)
@given(CONFIGS)
def test_every_shown_fix_holds_when_pasted(values: dict[str, object]) -> None:
    overrides = [MODEL, "algorithm.adv_estimator=grpo", *(f"{k}={v}" for k, v in values.items())]
    overrides = [o.replace("=True", "=true").replace("=False", "=false") for o in overrides]
    for finding, tokens in shown_fixes(preflight(overrides), overrides):
        assert_fix_holds(overrides, finding, tokens)

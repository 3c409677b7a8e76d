"""Fitting micro batches and token budgets to the GPU: largest that fits, passes every rule, and ``check`` agrees."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EXAMPLES
from memory_trace import FAMILY_MODELS
from test_memory import ARR, context

from verl_safe_launch.context import HardwareFacts
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.memory import KnobFit, candidates, estimate_memory, fit_knobs
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.presets import compose_for_launch

ACTOR = f"{ARR}.actor.ppo_micro_batch_size_per_gpu"
LOGPROB = f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu"
REF = f"{ARR}.ref.log_prob_micro_batch_size_per_gpu"


@pytest.fixture(autouse=True)
def declared_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the hardware.* tokens count (no nvidia-smi or Slurm detection on the test machine)."""
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def by_key(fits: tuple[KnobFit, ...]) -> dict[str, KnobFit]:
    return {f.key: f for f in fits}


def test_six_gpu_example_fits_and_passes_check() -> None:
    fits = by_key(fit_knobs(context()))
    assert set(fits) == {ACTOR, LOGPROB, REF}
    assert fits[ACTOR].value == 40 and fits[ACTOR].current == 8  # 120 per GPU: the largest divisor that fits
    # all 120 rows in one micro batch: 72.1 GiB, within the 10% margin, and the band (Qwen2's row measured within
    # 0.2% of full-depth traces, plus 5% fragmentation and the shards' own) stays under 80 GiB
    assert fits[LOGPROB].value == 120 and fits[REF].value == 120
    for fit in fits.values():
        assert fit.peak_gib * 1.1 <= 80
    high = estimate_memory(context({LOGPROB: 120})).stage("old log-prob")
    assert high is not None and high.total * 1.1 <= 80 and high.high <= 80
    overrides = [f.override for f in fits.values() if f.override]
    tokens = cli_tokens(["hardware.gpu_memory_gb=80", *overrides])
    request = ComposeRequest(overrides=tokens, config_files=(Path(EXAMPLES / "grpo_6gpu.yaml"),))
    preflight = run_preflight(compose_for_launch(request), HardwareFacts(gpu_memory_gb=80))
    assert preflight.ok, [f for f in preflight.findings if f.severity is Severity.ERROR]


def test_the_fitted_value_is_the_largest_that_fits() -> None:
    fit = by_key(fit_knobs(context()))[ACTOR]
    assert fit.value is not None
    over = estimate_memory(context({ACTOR: 60})).stage("actor update")  # the next divisor of 120 above 40
    assert over is not None and (over.total * 1.1 > 80 or over.high > 80)
    assert "up to 58 would fit, 40 is the largest valid value" in fit.reason
    edge = estimate_memory(context({ACTOR: 59})).stage("actor update")
    assert edge is not None and (edge.total * 1.1 > 80 or edge.high > 80)


def test_cap_bounds_each_knob() -> None:
    fits = by_key(fit_knobs(context(), cap={ACTOR: 10, LOGPROB: 7}))
    assert fits[ACTOR].value == 10 and fits[LOGPROB].value == 6 and fits[REF].value == 120


def test_margin_lowers_the_fit() -> None:
    loose, strict = by_key(fit_knobs(context(), margin=0.0)), by_key(fit_knobs(context(), margin=1.0))
    assert strict[LOGPROB].value is not None and loose[LOGPROB].value is not None
    assert strict[LOGPROB].value < loose[LOGPROB].value


def test_without_gpu_size_nothing_is_fitted() -> None:
    fits = fit_knobs(context(gpu=None))
    assert {f.value for f in fits} == {None}
    assert fits[0].reason == "GPU memory unknown: set hardware.gpu_memory_gb (e.g. hardware.gpu_memory_gb=80)"


def test_nothing_fits_on_a_small_gpu_and_the_reason_says_offload() -> None:
    fit = by_key(fit_knobs(context(gpu=24)))[ACTOR]
    assert fit.value is None and fit.override is None
    assert fit.reason.startswith("even the smallest value needs ")
    assert fit.reason.endswith(
        "; offload it (actor_rollout_ref.actor.fsdp_config.param_offload=true "
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true)"
    )
    offloaded = {
        f"{ARR}.actor.fsdp_config.param_offload": True,
        f"{ARR}.actor.fsdp_config.optimizer_offload": True,
    }
    again = by_key(fit_knobs(context(offloaded, gpu=24)))[ACTOR]
    assert again.reason.endswith(
        "; or keep the shards on the CPU (actor_rollout_ref.actor.strategy=fsdp2 "
        "actor_rollout_ref.actor.fsdp_config.offload_policy=true)"
    )


def test_dynamic_batching_fits_token_budgets() -> None:
    fits = by_key(fit_knobs(context({f"{ARR}.actor.use_dynamic_bsz": True})))
    budget = fits[f"{ARR}.actor.ppo_max_token_len_per_gpu"]
    assert budget.value is not None and budget.value % 512 == 0 and budget.value >= 1536
    assert f"{ARR}.rollout.log_prob_max_token_len_per_gpu" in fits


def test_critic_budget_is_added_with_plus_when_verl_yaml_lacks_it() -> None:
    fits = by_key(
        fit_knobs(context({"algorithm.adv_estimator": "gae", "critic.model.path": "Qwen/Qwen2.5-0.5B"}))
    )
    critic = fits["critic.ppo_infer_max_token_len_per_gpu"]
    assert critic.add and critic.override is not None and critic.override.startswith("+critic.")


def test_candidates_are_divisors_or_budget_steps() -> None:
    assert candidates(58, False, 120) == [40, 30, 24, 20, 15, 12, 10, 8, 6, 5, 4, 3, 2, 1]
    assert candidates(1300, True, None) == [1024, 512]
    assert candidates(300, True, None)[:2] == [300, 299]


def _model_path(name: str, tmp_path: Path) -> str:
    """The bundled table's name, or a directory with the config.json transformers writes for the model."""
    import json

    import memory_trace

    if name not in memory_trace.FROM_TRANSFORMERS:
        return name
    folder = tmp_path / name.split("/")[-1]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(memory_trace.config_dict(name)))
    return str(folder)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_fitted_micro_batches_fit_the_traced_peak(name: str, tmp_path: Path) -> None:
    """--fit's log-prob and update micro batches, with the model's micro-batch part replaced by a fake-tensor
    trace of that micro batch (two layers traced; the update's other layers add their checkpointed inputs)."""
    import memory_trace

    path = _model_path(name, tmp_path)
    # 8k-token sequences, 380 rows per GPU: memory, not the rows, decides the micro batch
    many = {f"{ARR}.model.path": path, f"{ARR}.rollout.n": 38, "data.max_response_length": 7680}
    fits = by_key(fit_knobs(context(many)))
    for key, mode, stage_name in ((LOGPROB, "logprob", "old log-prob"), (ACTOR, "update", "actor update")):
        value = fits[key].value
        assert value is not None
        est = estimate_memory(context({**many, key: value}))
        stage = est.stage(stage_name)
        assert stage is not None
        seq = int(stage.batch.split("×")[1].split()[0]) if "×" in stage.batch else 1536
        case = memory_trace.Case(name, value, seq, mode, mode == "update", layers=2)
        traced = memory_trace.trace(case)["traced_total"]
        arch = memory_trace.architecture(name)
        traced += (arch.num_hidden_layers - 2) * 2 * arch.hidden_size * case.tokens if mode == "update" else 0
        micro = dict(stage.phases).get("micro batch", stage.total)
        peak = micro - stage.batch_gib + traced / (1 << 30)
        assert peak <= 80, (key, value, peak)


@pytest.mark.parametrize("flash", [True, None], ids=["flash-attn declared", "flash-attn unknown"])
def test_estimate_check_and_fit_give_one_verdict(flash: bool | None) -> None:
    """Qwen2.5-7B at 512+1024 tokens on 80 GiB: for every actor micro batch around the edge, estimate says 'fits'
    exactly when --fit would propose it, and check warns exactly when it would not."""
    base = {"data.max_prompt_length": 512, "data.max_response_length": 1024}
    hardware = HardwareFacts(gpu_memory_gb=80, flash_attn=flash)
    view = context(base).view
    ctx = context(base)
    fit = by_key(fit_knobs(type(ctx)(view, ctx.actor_arch, ctx.critic_arch, hardware)))[ACTOR]
    largest = fit.fits_up_to
    assert largest is not None and fit.value is not None and fit.value <= largest
    for micro in range(max(1, largest - 4), largest + 5):
        changed = context({**base, ACTOR: micro})
        ctx_m = type(changed)(changed.view, changed.actor_arch, changed.critic_arch, hardware)
        stage = estimate_memory(ctx_m).stage("actor update")
        assert stage is not None
        findings = run_preflight_memory(ctx_m)
        warned = any(f.rule_id in ("memory-stage-tight", "memory-stage-out-of-memory") for f in findings)
        assert (stage.verdict == "fits") == (micro <= largest) == (not warned), (
            micro,
            stage.verdict,
            largest,
        )
        if micro > largest:
            assert stage.verdict in ("does not fit", "out of memory")


def run_preflight_memory(ctx: object) -> list[object]:
    from verl_safe_launch.memory import memory_findings

    return [f for f in memory_findings(ctx) if "actor update" in f.message]  # type: ignore[arg-type]

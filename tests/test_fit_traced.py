"""No false fits: for every traced family, shapes scanned up to the edge of the band, the micro batch ``--fit``
proposes holds its traced peak plus the static terms within the GPU.

The traced peak of a micro batch is per token at full depth: each family's full-depth traces at 1 × 8192 and
4 × 1024 tokens (bench/memory_calibration.json) give the same bytes per token to within 1% (checked here), so a
micro batch of any shape costs that rate times its tokens. A few shapes are also traced live at two layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import memory_trace as mt
import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_memory import ARR, base_view

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.memory import GIB, estimate_memory, fit_knobs, stage_at
from verl_safe_launch.memory.sources import resolve
from verl_safe_launch.rules import with_values

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
STAGES = {
    "ref log-prob": ("logprob", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu"),
    "actor update": ("update", ""),
}
ACTOR = f"{ARR}.actor.ppo_micro_batch_size_per_gpu"


def rate(model: str, mode: str, ckpt: bool) -> float:
    """Traced bytes per token of a micro batch at full depth (the larger of the two shapes' rates)."""
    data = mt.load_cache()["cases"]
    rates = [
        data[c.key]["traced_total"] / c.tokens
        for c in mt.full_cases((model,))
        if (c.mode, c.ckpt) == (mode, ckpt)
    ]
    assert len(rates) == 2, "run bench/calibrate_memory.py --full"
    return max(rates)


@pytest.mark.parametrize("model", mt.FULL_MODELS)
def test_traced_peaks_scale_with_tokens(model: str) -> None:
    """What lets one rate stand for every shape: both shapes' traces agree per token."""
    data = mt.load_cache()["cases"]
    for mode, ckpt in mt.MODES:
        cases = [c for c in mt.full_cases((model,)) if (c.mode, c.ckpt) == (mode, ckpt)]
        low, high = sorted(data[c.key]["traced_total"] / c.tokens for c in cases)
        assert high - low <= 0.01 * high, (model, mode, ckpt)


def context(model: str, seq: int, gpu: float, ckpt: bool) -> RuleContext:
    """The six-GPU example with the family's model, sequences of ``seq`` tokens and many rows per GPU (memory,
    not the batch, bounds the micro batch); no entropy in the update, as traced."""
    changes: dict[str, Any] = {
        "data.max_prompt_length": seq // 4,
        "data.max_response_length": seq - seq // 4,
        f"{ARR}.rollout.n": 48,
        f"{ARR}.model.enable_gradient_checkpointing": ckpt,
        f"{ARR}.actor.entropy_coeff": 0,
        f"{ARR}.actor.calculate_entropy": False,
    }
    view = with_values(base_view(), changes)
    view = ConfigView(dict(view.values), view.provenance)
    return RuleContext(view, mt.architecture(model), None, HardwareFacts(gpu_memory_gb=gpu, flash_attn=True))


@settings(
    max_examples=examples(24),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    model=st.sampled_from(mt.FULL_MODELS),
    seq=st.integers(1024, 16384),
    gpu=st.sampled_from([24.0, 40.0, 48.0, 80.0, 96.0, 141.0]),
    ckpt=st.booleans(),
)
def test_fitted_micro_batches_hold_their_traced_peak(model: str, seq: int, gpu: float, ckpt: bool) -> None:
    ctx = context(model, seq, gpu, ckpt)
    fits = {f.stage: f for f in fit_knobs(ctx)}
    for stage, (mode, _) in STAGES.items():
        fit = fits[stage]
        if fit.value is None:
            continue
        at = stage_at(ctx, stage)
        assert at is not None
        est = at(fit.value)
        tokens = fit.value * seq
        traced = rate(model, mode, ckpt and mode == "update") * tokens / GIB
        static = dict(est.phases).get("micro batch", est.total) - est.batch_gib
        assert static + traced <= gpu, (model, stage, fit.value, seq, static + traced)
        assert static + traced <= est.high  # the band holds the traced peak: it is measured
        if ctx.actor_arch is not None and ctx.actor_arch.vision is None:  # images are modelled, not traced
            assert est.low <= static + traced


@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(mt.FULL_MODELS),
    micro=st.integers(1, 6),
    seq=st.integers(256, 2048),
    mode=st.sampled_from(mt.MODES),
)
def test_estimates_at_random_shapes_match_a_live_trace_within_the_band(
    model: str, micro: int, seq: int, mode: tuple[str, bool]
) -> None:
    """A shape nobody stored, traced now at two layers: the estimate at the same depth is within 10%."""
    case = mt.Case(model, micro, seq, mode[0], mode[1], layers=2)
    traced = mt.trace(case)["traced_total"]
    act, logits = mt.estimate(case)
    assert abs(act + logits - traced) <= 0.10 * traced, case.key


def test_the_fit_stops_at_the_band_edge() -> None:
    """The micro batch above the fitted one would break the margin or the band: the fit is the largest."""
    ctx = context("google/gemma-3-4b-it", 4096, 80.0, True)
    fit = next(f for f in fit_knobs(ctx) if f.key == ACTOR)
    assert fit.value is not None
    over = estimate_memory(replace(ctx, view=with_values(ctx.view, {ACTOR: fit.value + 1}))).stage(
        "actor update"
    )
    assert over is not None and (over.total * 1.1 > 80 or over.high > 80)
    assert resolve(ctx.actor_arch).traced  # type: ignore[arg-type]

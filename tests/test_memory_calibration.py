"""The memory model against traces of the real transformers modules on fake tensors.

The tracer samples memory after every op (a test below proves a one-op peak is caught). Cached traces, kept in
bench/memory_calibration.json by ``bench/calibrate_memory.py``: the full-depth grid (Qwen2.5-0.5B/1.5B,
Llama-3.1-8B, Qwen3-0.6B; micro 1/4/8, sequences 512/2048, with and without checkpointing), the logits variants,
and eight families at two token counts each (``--families``; Mistral-7B and Phi-3-mini have 32k vocabularies).
No GPU is needed: the trace runs on CPU fake tensors (bench/gpu_memory_check.py measures on a real GPU).
"""

from __future__ import annotations

import memory_trace as cm
import pytest

pytest.importorskip("transformers")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tracer_catches_a_peak_that_lives_for_one_op() -> None:
    """``x = x + 1`` holds the old and the new ``x`` for the length of one op: the peak is two copies, not one."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    n = 1 << 20
    with FakeTensorMode():
        model = torch.nn.Linear(4, 4)
        tracker = cm.make_tracker(model, vocab=-1)
        tracker.track_external(model)
        with tracker:
            x = torch.ones(n)
            for _ in range(3):
                x = x + 1
            tracker.sample("end")
    assert tracker.peak == 2 * 4 * n
    assert tracker.peak_op.endswith("(output)")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_small_traced_case_within_15_percent() -> None:
    case = cm.Case("Qwen/Qwen2.5-0.5B", 2, 256, "update", True)
    traced = cm.trace(case, layers=2)
    activations, logits = cm.estimate(case, layers=2)
    assert traced["traced_total"] > 0
    assert abs(activations + logits - traced["traced_total"]) <= 0.15 * traced["traced_total"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("model", "mode", "ckpt"),
    [
        ("mistralai/Mistral-7B-v0.1", "logprob", False),
        ("mistralai/Mistral-7B-v0.1", "update", True),
        ("microsoft/Phi-3-mini-4k-instruct", "logprob", False),
    ],
)
def test_small_vocabulary_layer_peak_is_traced_within_10_percent(model: str, mode: str, ckpt: bool) -> None:
    """A 32k vocabulary leaves the peak to the decoder layer: its terms are checked, not hidden by the logits."""
    case = cm.Case(model, 2, 1024, mode, ckpt, layers=1)
    traced = cm.trace(case)
    activations, logits = cm.estimate(case)
    assert traced["traced_logits"] < 0.5 * traced["traced_total"], "the logits set this peak"
    assert abs(activations + logits - traced["traced_total"]) <= 0.10 * traced["traced_total"]


def test_cached_family_cases_are_within_10_percent() -> None:
    """Eight families (32k-vocabulary Mistral and Phi-3, MoE, MLA, a vision-language model), two shapes each."""
    data = cm.load_cache()
    cases = [c for c in cm.family_cases() if c.key in data["cases"]]
    assert len(cases) == len(cm.family_cases()), "run bench/calibrate_memory.py --families"
    for case in cases:
        activations, logits = cm.estimate(case)
        traced = data["cases"][case.key]["traced_total"]
        assert abs(activations + logits - traced) <= 0.10 * traced, case.key


def test_cached_calibration_grid_is_within_10_percent() -> None:
    data = cm.load_cache()
    cases = [c for c in cm.grid() if c.key in data["cases"]]
    assert len(cases) >= 36, "run bench/calibrate_memory.py to fill bench/memory_calibration.json"
    for case in cases:
        activations, logits = cm.estimate(case)
        traced = data["cases"][case.key]["traced_total"]
        assert abs(activations + logits - traced) <= 0.10 * traced, case.key


def test_cached_variants_and_feature_cases_are_within_10_percent() -> None:
    """Entropy, temperature, fused kernels, no flash-attn cross-entropy, Gemma-2 softcapping: each traced."""
    data = cm.load_cache()
    cases = [c for c in cm.variant_cases() if c.key in data["cases"]]
    assert len(cases) == len(cm.variant_cases()), "run bench/calibrate_memory.py --variants"
    for case in cases:
        activations, logits = cm.estimate(case)
        traced = data["cases"][case.key]["traced_total"]
        assert abs(activations + logits - traced) <= 0.10 * traced, case.key

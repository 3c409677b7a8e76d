"""Memory terms derived from a model's own code: families nobody calibrated within 10% of full-depth traces, the
calibrated rows agreeing with the derivation, exact parameters, hub configs read with their class's defaults, the
disk cache, and the fallback when transformers cannot build the model.

The oracle is a fake-tensor trace of the real transformers modules at full depth (bench/memory_calibration.json,
``bench/calibrate_memory.py --full``) or, here, at a small depth; the derivation traces one layer of each kind
at another shape and scales. No GPU is needed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import memory_trace as mt
import pytest

from verl_safe_launch.inputs import from_config_dict, load_architecture
from verl_safe_launch.memory.derive import from_json, traced_terms, with_traced
from verl_safe_launch.memory.sources import bands, resolve
from verl_safe_launch.memory.terms import FAMILIES, Pass, pass_peak, traced_peak

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
UNCALIBRATED = (
    "THUDM/GLM-4-9B-0414",
    "allenai/OLMo-2-0425-1B",
    "google/gemma-3-1b-it",
    "google/gemma-3-4b-it",
    "llava-hf/llava-1.5-7b-hf",
)
CALIBRATED = tuple(m for m in mt.FULL_MODELS if m not in UNCALIBRATED)


def stored() -> dict[str, Any]:
    return mt.load_cache()


@pytest.mark.parametrize("model", UNCALIBRATED)
def test_a_family_nobody_calibrated_is_within_10_percent_of_full_depth_traces(model: str) -> None:
    """GLM-4, OLMo-2, Gemma-3 (text, and vision with a sparse config), LLaVA-1.5: derived here, from the code, and
    held to every full-depth trace (log-prob, update with and without checkpointing, two shapes)."""
    source = resolve(mt.architecture(model))
    assert source.traced and source.arch.traced is not None
    assert source.how.startswith("derived from the model code (")
    data = stored()
    cases = mt.full_cases((model,))
    assert all(c.key in data["cases"] for c in cases), "run bench/calibrate_memory.py --full"
    for case in cases:
        act, logits = mt.estimate(case)
        traced = data["cases"][case.key]["traced_total"]
        assert abs(act + logits - traced) <= 0.10 * traced, case.key


def test_derived_terms_match_a_live_trace_at_another_depth_and_shape() -> None:
    """Gemma-3-1b derived at 1,024 tokens from its first layer and one of each kind, against a trace of its first
    six layers (five sliding-window, one global) at 2 × 640 tokens: every stage."""
    arch = resolve(mt.architecture("google/gemma-3-1b-it")).arch
    assert arch.traced is not None and arch.traced.kinds == 2
    for mode, ckpt in mt.MODES:
        case = mt.Case("google/gemma-3-1b-it", 2, 640, mode, ckpt, layers=6)
        traced = mt.trace(case)["traced_total"]
        act, logits = mt.estimate(case)
        assert abs(act + logits - traced) <= 0.02 * traced, case.key


@pytest.mark.parametrize("model", CALIBRATED)
def test_calibrated_rows_agree_with_the_derivation(model: str) -> None:
    """The rows are a fast path: at full depth, both shapes and every stage, each agrees with the terms derived
    from the model's code (stored by ``bench/memory_families.py --derive``) within its measured band plus the
    derivation's."""
    data = stored()["derivations"][model]
    arch = mt.architecture(model)
    derived = replace(arch, traced=from_json(data))
    assert pass_peak(arch, Pass(1, True, 1)) is not None and arch.model_type in FAMILIES
    limit = bands()["rows"].get(arch.model_type, max(bands()["rows"].values())) + bands()["derived"]
    for mode, ckpt in mt.MODES:
        for micro, seq in mt.FAMILY_SHAPES:
            p = Pass(
                micro * seq,
                mode == "update",
                arch.vocab_size,
                ckpt,
                softcap=bool(arch.final_logit_softcapping),
            )
            row, own = pass_peak(arch, p).total, traced_peak(derived, derived.traced, p).total  # type: ignore[arg-type]
            assert abs(row - own) <= limit * own + 1, (model, mode, ckpt, micro, seq)


def test_the_stored_derivations_are_what_the_code_derives_now() -> None:
    """A live derivation of one dense and one latent-attention MoE family equals what the table was made from."""
    for model in ("meta-llama/Llama-3.1-8B", "deepseek-ai/DeepSeek-V2-Lite"):
        live, _ = traced_terms(mt.config_of(model))
        assert replace(live, seconds=0.0, cached=False, path="") == replace(
            from_json(stored()["derivations"][model]), seconds=0.0
        )


def _transformers_count(config: dict[str, Any]) -> int:
    """Parameters of the model transformers builds from the config (meta device, a tied head once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    values = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(config["model_type"], **values)
    auto: Any = AutoModelForImageTextToText if getattr(cfg, "vision_config", None) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    return int(sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("model", mt.FULL_MODELS)
def test_parameters_are_exact(model: str) -> None:
    """What the estimate counts is what transformers builds: a tied head once (Gemma-3), each family's vision
    tower (SigLIP, CLIP, Qwen2.5-VL's) from its own config, experts and latent attention in full."""
    source = resolve(mt.architecture(model))
    assert source.arch.params == _transformers_count(mt.config_of(model))


def test_a_hub_config_relying_on_defaults_loads_as_transformers_loads_it(tmp_path: Path) -> None:
    """Gemma-3-4b's shipped text_config names four numbers; its heads, KV heads, head width, vocabulary and tied
    head are Gemma3TextConfig's defaults, read here by transformers' own loader from the same directory."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(mt.config_of("google/gemma-3-4b-it")))
    arch = load_architecture(str(tmp_path))
    assert arch is not None
    text = AutoConfig.from_pretrained(tmp_path).get_text_config()
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
    )
    assert (arch.vocab_size, arch.tie_word_embeddings, arch.sliding_window) == (
        text.vocab_size,
        text.tie_word_embeddings,
        text.sliding_window,
    )
    assert (
        arch.vision is not None and arch.vision.depth == 27 and arch.vision.merge == 16
    )  # 4096 patches → 256


def test_the_derivation_is_cached_on_disk_and_says_so(knowledge_cache: Path) -> None:
    config = dict(mt.config_of("allenai/OLMo-2-0425-1B"), num_hidden_layers=3)  # a digest no other test uses
    arch = from_config_dict(config, "olmo-3-layers", "test")
    first, why = with_traced(arch)
    assert why is None and first.traced is not None and not first.traced.cached
    assert first.traced.describe().startswith(
        "derived from the model code (Olmo2ForCausalLM, 3 layers of 1 kind; "
    )
    assert first.traced.describe().endswith(" s, cached)")
    path = knowledge_cache / "verl-safe-launch" / first.traced.path
    assert path.is_file() and json.loads(path.read_text())["slots"] == [0, 1, 1]
    again, _ = with_traced(replace(arch, traced=None))
    assert again.traced is not None and again.traced.cached
    assert again.traced.describe().endswith(
        "; cached, 2.2 s when derived)".replace("2.2", f"{first.traced.seconds:.1f}")
    )
    other, _ = traced_terms(dict(config, intermediate_size=4096))  # another config: derived again
    assert not other.cached and other.path != first.traced.path


def test_a_model_transformers_cannot_build_falls_back_to_the_closest_family() -> None:
    """An unknown model_type with experts: the closest calibrated MoE row stands in, its band the worst error
    that row was measured at when standing in for the traced families."""
    config = {
        "model_type": "acme_moe",
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 2048,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    source = resolve(from_config_dict(config, "acme", "test"))
    assert not source.traced and source.fallback in ("mixtral", "qwen2_moe", "qwen3_moe")
    assert source.band == bands()["fallback"][source.fallback] >= 0.2
    assert f"closest traced family '{source.fallback}' stands in" in source.how


def test_the_optimizer_step_is_traced() -> None:
    """AdamW's foreach step (verl's default on GPUs) makes one temporary copy of the parameters it updates; the
    estimate's optimizer phase adds exactly that (fused: none; per-tensor: a fraction)."""
    from verl_safe_launch.memory.estimate import OPTIMIZER_STEP_TEMP
    from verl_safe_launch.memory.trace import optimizer_step

    assert optimizer_step() == pytest.approx(OPTIMIZER_STEP_TEMP, abs=1e-3)
    assert optimizer_step(fused=True, foreach=False) == pytest.approx(0.0, abs=1e-3)

"""The memory model: byte formulas on hand-checkable cases, every memory key moving the estimate the right way."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import EXAMPLES

from verl_safe_launch.compose import compose
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.inputs import ComposeRequest, load_architecture
from verl_safe_launch.memory import (
    GIB,
    Entropy,
    MemoryEstimate,
    Pass,
    estimate_memory,
    kv_bytes_per_token,
    layer_saved,
    logits_bytes,
    model_params,
    pass_peak,
)
from verl_safe_launch.rules import with_values

ARR = "actor_rollout_ref"
QWEN_05 = load_architecture("Qwen/Qwen2.5-0.5B")
LLAMA_8 = load_architecture("meta-llama/Llama-3.1-8B")
QWEN3_06 = load_architecture("Qwen/Qwen3-0.6B")


@functools.cache
def base_view() -> ConfigView:
    return compose(ComposeRequest(config_files=(Path(EXAMPLES / "grpo_6gpu.yaml"),))).view


def context(changes: dict[str, object] | None = None, gpu: float | None = 80) -> RuleContext:
    view = with_values(base_view(), changes or {})
    view = ConfigView(dict(view.values), view.provenance)
    actor = load_architecture(view.get(f"{ARR}.model.path"))
    critic = load_architecture(view.get("critic.model.path"))
    # flash-attn declared: the cases below follow verl's flash-attn log-prob path unless they switch it off
    return RuleContext(view, actor, critic, HardwareFacts(gpu_memory_gb=gpu, flash_attn=True))


def estimate(changes: dict[str, object] | None = None, gpu: float | None = 80) -> MemoryEstimate:
    return estimate_memory(context(changes, gpu))


# --- byte formulas, checked by hand -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "tp", "expected"),
    [
        (LLAMA_8, 1, 2 * 32 * 8 * 128 * 2),  # K and V, 32 layers, 8 KV heads of 128, bf16
        (LLAMA_8, 2, 2 * 32 * 4 * 128 * 2),
        (LLAMA_8, 16, 2 * 32 * 1 * 128 * 2),  # fewer KV heads than ranks: replicated, one per rank
        (QWEN_05, 1, 2 * 24 * 2 * 64 * 2),
    ],
)
def test_kv_bytes_per_token(arch: object, tp: int, expected: int) -> None:
    assert kv_bytes_per_token(arch, tp) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        # 16h + 4q + 4kv + 8f + 4 heads + 8, the saved-tensor census of one layer (bench/calibrate_memory.py)
        (QWEN_05, 16 * 896 + 4 * 896 + 4 * 128 + 8 * 4864 + 4 * 14 + 8),
        (LLAMA_8, 16 * 4096 + 4 * 4096 + 4 * 1024 + 8 * 14336 + 4 * 32 + 8),
        # Qwen3 q/k RMSNorm: 10q + 10kv + 8 heads + 4 kv heads
        (QWEN3_06, 16 * 1024 + 10 * 2048 + 10 * 1024 + 8 * 3072 + 8 * 16 + 4 * 8 + 8),
    ],
)
def test_layer_saved_bytes_per_token(arch: object, expected: int) -> None:
    assert layer_saved(arch, Pass(tokens=1, backward=True, vocab=1)) == expected  # type: ignore[arg-type]


def test_model_params_match_the_architecture_and_the_value_head() -> None:
    assert QWEN_05 is not None and LLAMA_8 is not None
    assert model_params(QWEN_05) == QWEN_05.params == 494_032_768
    assert (
        model_params(QWEN_05, value_head=True) == QWEN_05.params + 896
    )  # tied: embeddings stay, h→1 head added
    assert model_params(LLAMA_8, value_head=True) == LLAMA_8.params - 128256 * 4096 + 4096


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (Pass(tokens=1000, backward=False, vocab=100), 2 * 1000 * 100 + 8 * 1000),
        (Pass(tokens=1000, backward=False, vocab=100, entropy=Entropy.EAGER), 10 * 1000 * 100 + 8000),
        (Pass(tokens=1000, backward=False, vocab=100, entropy=Entropy.COMPILED), 2 * 1000 * 100 + 8000),
        (Pass(tokens=1000, backward=False, vocab=100, temperature_copy=True), 4 * 1000 * 100 + 8000),
        (
            Pass(tokens=1000, backward=False, vocab=100, entropy=Entropy.CHUNKED, entropy_chunk=10),
            2 * 1000 * 100 + 12 * 10 * 100 + 8000,
        ),
        (Pass(tokens=1000, backward=True, vocab=100, entropy=Entropy.EAGER), 18 * 1000 * 100 + 8000),
    ],
)
def test_logits_bytes(p: Pass, expected: int) -> None:
    assert logits_bytes(p, hidden=64) == expected


def test_the_vocabulary_decides_the_forward_peak_unless_it_is_a_value_head() -> None:
    assert QWEN_05 is not None
    lm = pass_peak(QWEN_05, Pass(tokens=4096, backward=False, vocab=QWEN_05.vocab_size))
    value = pass_peak(QWEN_05, Pass(tokens=4096, backward=False, vocab=1))
    assert lm.phase == "logits of the forward" and lm.logits == 2 * 4096 * 151936 + 8 * 4096
    # act(gate) * up is written while gate's activation and up are alive: three MLP-width bf16 tensors
    assert (
        value.phase == "one layer's forward" and value.activations == (6 * 4864 + 8 * 896 + 4 * 64 + 8) * 4096
    )


def test_checkpointing_keeps_one_layer_input_per_layer() -> None:
    assert QWEN_05 is not None
    ckpt = pass_peak(QWEN_05, Pass(tokens=1000, backward=True, vocab=QWEN_05.vocab_size))
    head = 8 * 896 + 4 + 4 * 64 + 2 * 896
    assert ckpt.phase == "start of backward (logits)"
    assert ckpt.activations == (24 * 2 * 896 + head) * 1000


# --- the estimate of the 6-GPU example --------------------------------------------------------------------


def test_six_gpu_example_stages_and_shards() -> None:
    est = estimate()
    assert [s.name for s in est.stages] == ["rollout", "old log-prob", "ref log-prob", "actor update"]
    update = est.stage("actor update")
    assert update is not None and update.verdict == "fits"
    p = load_architecture("Qwen/Qwen2.5-7B-Instruct").params  # type: ignore[union-attr]
    assert update.get("parameters") == pytest.approx(p * 4 / 6 / GIB)  # fp32 shard over 6 GPUs
    assert update.get("optimizer") == pytest.approx(2 * p * 4 / 6 / GIB)
    assert update.get("gradients") == pytest.approx(p * 4 / 6 / GIB)
    assert update.low < update.total < update.high
    assert est.rollout is not None and est.rollout.max_model_len == 32768  # null: max_position_embeddings


def test_without_a_gpu_size_there_are_no_verdicts() -> None:
    est = estimate(gpu=None)
    assert all(s.verdict is None for s in est.stages)
    assert est.rollout is not None and est.rollout.capacity_tokens is None
    assert est.assumptions[0] == "GPU memory unknown: no verdicts (set hardware.gpu_memory_gb=80)"


def test_unknown_model_says_which_key_to_set() -> None:
    est = estimate({f"{ARR}.model.path": "/nowhere/my-private-model"})
    assert est.stages == ()
    assert est.missing == (
        "no architecture for actor model '/nowhere/my-private-model': not a local directory with config.json, "
        "not in the local Hugging Face cache, not in the bundled table; set actor_rollout_ref.model.path to a "
        "local model directory (config.json is enough) or a known Hugging Face repo id"
    )


def test_a_local_model_directory_is_read(tiny_model: Path) -> None:
    est = estimate({f"{ARR}.model.path": str(tiny_model)})
    assert est.missing is None and est.stage("actor update") is not None


# --- every memory-relevant key moves the estimate the right way ---------------------------------------------

A, F, M, R = f"{ARR}.actor", f"{ARR}.actor.fsdp_config", f"{ARR}.model", f"{ARR}.rollout"
NOCKPT = {f"{M}.enable_gradient_checkpointing": False}
EAGER = {f"{F}.use_torch_compile": False}
DYN = {f"{A}.use_dynamic_bsz": True, f"{A}.ppo_max_token_len_per_gpu": 4096}


@pytest.mark.parametrize(
    ("base", "changes", "stage", "component", "direction"),
    [
        ({}, {f"{F}.param_offload": True}, "rollout", "parameters", -1),
        ({}, {f"{F}.param_offload": True}, "actor update", "parameters", 0),
        ({}, {f"{F}.optimizer_offload": True}, "old log-prob", "optimizer", -1),
        ({}, {f"{F}.optimizer_offload": True}, "actor update", "optimizer", 0),
        (
            {},
            {f"{F}.strategy": "fsdp2", f"{A}.strategy": "fsdp2", f"{F}.offload_policy": True},
            "actor update",
            "optimizer",
            -1,
        ),
        ({}, {f"{F}.model_dtype": "bf16"}, "actor update", "parameters", -1),
        ({}, {f"{F}.fsdp_size": 2}, "actor update", "parameters", 1),
        ({}, NOCKPT, "actor update", "activations", 1),
        ({}, {f"{M}.enable_activation_offload": True}, "actor update", "activations", -1),
        ({}, {f"{M}.use_remove_padding": False}, "old log-prob", "logits and temporaries", 1),
        ({}, {f"{A}.ulysses_sequence_parallel_size": 2}, "actor update", "logits and temporaries", -1),
        ({}, {f"{F}.ulysses_sequence_parallel_size": 2}, "actor update", "activations", -1),
        (DYN, {f"{A}.ppo_max_token_len_per_gpu": 16384}, "actor update", "logits and temporaries", 1),
        ({}, EAGER, "old log-prob", "logits and temporaries", 1),
        (
            EAGER,
            {f"{F}.entropy_from_logits_with_chunking": True},
            "old log-prob",
            "logits and temporaries",
            -1,
        ),
        (
            EAGER | {f"{F}.entropy_from_logits_with_chunking": True},
            {f"{F}.entropy_from_logits_chunk_size": 8192},
            "old log-prob",
            "logits and temporaries",
            1,
        ),
        ({}, {f"{M}.use_fused_kernels": True}, "old log-prob", "logits and temporaries", -1),
        ({}, {f"{A}.entropy_coeff": 0.01}, "actor update", "logits and temporaries", 1),
        # recomputed in backward: the traced peak is the same, only later
        (
            EAGER | {f"{A}.entropy_coeff": 0.01},
            {f"{F}.entropy_checkpointing": True},
            "actor update",
            "logits and temporaries",
            0,
        ),
        ({}, {f"{R}.temperature": 0.7}, "old log-prob", "logits and temporaries", 1),
        (NOCKPT, {f"{M}.tiled_mlp.enabled": True}, "actor update", "activations", -1),
        (NOCKPT, {f"{M}.use_liger": True}, "actor update", "activations", -1),
        ({}, {f"{M}.lora_rank": 32}, "actor update", "optimizer", -1),
        ({}, {f"{M}.lora_rank": 32}, "actor update", "gradients", -1),
        ({}, {f"{F}.reshard_after_forward": False}, "actor update", "gathered parameters", 1),
        ({}, {f"{F}.forward_prefetch": True}, "old log-prob", "gathered parameters", 1),
        ({}, {f"{R}.gpu_memory_utilization": 0.3}, "rollout", "KV cache", -1),
        ({}, {f"{R}.name": "sglang"}, "rollout", "KV cache", -1),
        ({}, {f"{R}.max_num_seqs": 1024}, "rollout", "activations", 1),
        ({}, {f"{R}.max_num_batched_tokens": 32768}, "rollout", "activations", 1),
        ({}, {f"{R}.tensor_model_parallel_size": 1}, "rollout", "parameters", 1),
        ({}, {f"{R}.dtype": "float32"}, "rollout", "parameters", 1),
        ({}, {f"{R}.free_cache_engine": False}, "actor update", "KV cache", 1),
        ({}, {f"{R}.log_prob_micro_batch_size_per_gpu": 16}, "old log-prob", "logits and temporaries", 1),
        (
            {},
            {f"{ARR}.ref.log_prob_micro_batch_size_per_gpu": 2},
            "ref log-prob",
            "logits and temporaries",
            -1,
        ),
        ({}, {f"{A}.ppo_micro_batch_size_per_gpu": 2}, "actor update", "activations", -1),
        ({}, {"data.max_response_length": 4096}, "actor update", "activations", 1),
    ],
)
def test_memory_key_moves_the_estimate(
    base: dict[str, object], changes: dict[str, object], stage: str, component: str, direction: int
) -> None:
    before, after = estimate(base).stage(stage), estimate({**base, **changes}).stage(stage)
    assert before is not None and after is not None
    delta = after.get(component) - before.get(component)
    assert (delta > 1e-9) - (delta < -1e-9) == direction, (before.components, after.components)


def test_max_model_len_null_means_the_model_context() -> None:
    assert estimate().rollout.max_model_len == 32768  # type: ignore[union-attr]
    assert estimate({f"{R}.max_model_len": 1536}).rollout.max_model_len == 1536  # type: ignore[union-attr]


def test_chunked_prefill_off_raises_the_batched_tokens_to_max_model_len() -> None:
    on, off = estimate(), estimate({f"{R}.enable_chunked_prefill": False})
    assert off.stage("rollout").get("activations") > on.stage("rollout").get("activations")  # type: ignore[union-attr]


def test_ref_stage_only_with_a_kl_term_and_critic_only_with_gae() -> None:
    names = [s.name for s in estimate({f"{A}.use_kl_loss": False}).stages]
    assert "ref log-prob" not in names
    est = estimate({"algorithm.adv_estimator": "gae", "critic.model.path": "Qwen/Qwen2.5-0.5B"})
    critic = est.stage("critic")
    assert critic is not None and critic.knob == "critic.ppo_infer_max_token_len_per_gpu"
    assert "token budget 32768" in critic.batch  # V1 always runs the critic with this budget


def test_critic_offload_frees_the_rollout_stage() -> None:
    gae = {"algorithm.adv_estimator": "gae", "critic.model.path": "Qwen/Qwen2.5-0.5B"}
    before = estimate(gae).stage("rollout")
    after = estimate({**gae, "critic.fsdp.param_offload": True, "critic.fsdp.optimizer_offload": True}).stage(
        "rollout"
    )
    assert before is not None and after is not None and after.total < before.total


def test_estimate_is_pure_and_repeatable() -> None:
    ctx = context()
    assert estimate_memory(ctx) == estimate_memory(replace(ctx))

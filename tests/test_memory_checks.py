"""Memory findings in the pre-flight: the rollout KV cache and weights, and the per-stage verdicts."""

from __future__ import annotations

from test_memory import ARR, context

from verl_safe_launch.findings import Severity
from verl_safe_launch.memory import memory_findings

R = f"{ARR}.rollout"
LLAMA_128K = {f"{ARR}.model.path": "meta-llama/Llama-3.1-8B-Instruct", f"{R}.gpu_memory_utilization": 0.2}


def ids(changes: dict[str, object], gpu: float | None = 80) -> list[str]:
    return [f.rule_id for f in memory_findings(context(changes, gpu))]


def test_kv_below_one_max_model_len_sequence_fires_and_the_fix_clears_it() -> None:
    (kv,) = [f for f in memory_findings(context(LLAMA_128K)) if f.rule_id == "rollout-kv-below-max-model-len"]
    assert kv.severity is Severity.ERROR
    assert kv.message == (
        "the KV cache holds ~104927 tokens per rollout replica (gpu_memory_utilization 0.2 × 80 GiB − weights "
        "7.5 GiB − activations 1.1 GiB − CUDA graphs 1.0 GiB, 64 KiB per token), fewer than one sequence of "
        "max_model_len 131072 (null: the model's max_position_embeddings); vLLM refuses to start"
    )
    assert kv.fix == (
        "actor_rollout_ref.rollout.max_model_len=1536; or actor_rollout_ref.rollout.gpu_memory_utilization=0.22"
    )
    assert kv.keys[0] == f"{R}.max_model_len"
    fixed = ids({**LLAMA_128K, f"{R}.max_model_len": 1536})
    assert "rollout-kv-below-max-model-len" not in fixed
    assert "rollout-kv-concurrency" in fixed  # 240 sequences × 1536 tokens still do not fit at once


def test_cuda_graphs_come_on_top_when_vllm_does_not_profile_them() -> None:
    """vLLM >= 0.21 takes its CUDA graphs from its share; VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 puts them
    back on top of it, as before: the KV cache grows by the graphs' size and the rollout stage by as much."""
    from verl_safe_launch.memory import estimate_memory

    env = "ray_kwargs.ray_init.runtime_env.env_vars.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
    inside, outside = estimate_memory(context(LLAMA_128K)), estimate_memory(context({**LLAMA_128K, env: "0"}))
    assert inside.rollout is not None and outside.rollout is not None
    assert inside.rollout.graphs_inside and not outside.rollout.graphs_inside
    graphs = inside.rollout.graphs_bytes
    assert outside.rollout.kv_bytes == (inside.rollout.kv_bytes or 0) + graphs
    inside_stage, outside_stage = inside.stage("rollout"), outside.stage("rollout")
    assert inside_stage is not None and outside_stage is not None
    assert abs(outside_stage.total - inside_stage.total - graphs / (1 << 30)) < 1e-6


def test_concurrency_warning_clears_with_the_suggested_fraction() -> None:
    findings = memory_findings(context({**LLAMA_128K, f"{R}.max_model_len": 1536}))
    (warn,) = [f for f in findings if f.rule_id == "rollout-kv-concurrency"]
    assert warn.severity is Severity.WARNING
    assert "240 concurrent sequences × 1536 tokens = 368640" in warn.message
    util = float(warn.fix.split("=")[1])  # type: ignore[union-attr]
    assert ids({**LLAMA_128K, f"{R}.max_model_len": 1536, f"{R}.gpu_memory_utilization": util}) == []


def test_weights_not_fitting_per_rank() -> None:
    big = {f"{ARR}.model.path": "Qwen/Qwen2.5-72B-Instruct", f"{R}.gpu_memory_utilization": 0.5}
    found = memory_findings(context(big))
    weights = [f for f in found if f.rule_id == "rollout-weights-per-rank"]
    assert len(weights) == 1 and weights[0].severity is Severity.ERROR
    assert "does not hold the model: weights 67.7 GiB per GPU at TP 2" in weights[0].message


def test_stage_out_of_memory_names_the_knob_and_the_fitted_value() -> None:
    found = memory_findings(context({f"{ARR}.actor.ppo_micro_batch_size_per_gpu": 120}))
    (oom,) = [f for f in found if f.rule_id == "memory-stage-out-of-memory"]
    assert oom.keys == (f"{ARR}.actor.ppo_micro_batch_size_per_gpu",)
    assert oom.message.startswith("actor update needs ~")
    assert oom.fix is not None and oom.fix.startswith(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 (est."
    )


def test_no_hardware_no_memory_findings() -> None:
    assert ids({f"{ARR}.actor.ppo_micro_batch_size_per_gpu": 120}, gpu=None) == []


def test_unknown_model_is_an_info_finding() -> None:
    (info,) = memory_findings(context({f"{ARR}.model.path": "/nowhere/model"}))
    assert info.rule_id == "memory-model-unknown" and info.severity is Severity.INFO
    assert info.message.startswith(
        "memory estimate skipped: no architecture for actor model '/nowhere/model'"
    )

"""The engine rules, one row each with its exact message and fix; each fires only for the engine the config names."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from test_rules_batch import context, errors_of

from verl_safe_launch.rules import first_tokens, run_rules

Q7 = "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct"
MX = "actor_rollout_ref.model.path=mistralai/Mixtral-8x7B-v0.1"
T = "actor_rollout_ref.rollout.tensor_model_parallel_size"
M = "actor_rollout_ref.actor.megatron"


class Case(NamedTuple):
    rule_id: str
    overrides: list[str]
    message: str
    fix: str | None


CASES = [
    Case(
        "vllm-tp-heads",
        [Q7, "actor_rollout_ref.rollout.tensor_model_parallel_size=8"],
        'actor_rollout_ref.rollout.tensor_model_parallel_size=8 does not split Qwen/Qwen2.5-7B-Instruct\'s 28 attention heads and 4 KV heads (from bundled table (Qwen/Qwen2.5-7B-Instruct)): vLLM stops with "Total number of attention heads (28) must be divisible by tensor parallel size (8)." (ModelConfig.verify_with_parallel_config); verl only finds out when it starts the rollout replicas',
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4 (valid: 1, 2, 4)",
    ),
    Case(
        "vllm-tp-heads",
        [Q7, "actor_rollout_ref.rollout.tensor_model_parallel_size=14", "trainer.n_gpus_per_node=14"],
        "actor_rollout_ref.rollout.tensor_model_parallel_size=14 does not split Qwen/Qwen2.5-7B-Instruct's 28 attention heads and 4 KV heads (from bundled table (Qwen/Qwen2.5-7B-Instruct)): vLLM's QKVParallelLinear stops with \"14 is not divisible by 4\" while loading the model (it splits KV heads evenly, or replicates them when there are fewer than the tensor parallel size, on a whole number of GPUs each); verl only finds out when it starts the rollout replicas",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 (valid: 1, 2)",
    ),
    Case(
        "sglang-tp-heads",
        [
            Q7,
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.data_parallel_size=4",
        ],
        "rollout tensor × data parallel = 2 × 4 = 8 (verl starts SGLang with tp_size = tensor × data parallel) does not split Qwen/Qwen2.5-7B-Instruct's 28 attention heads and 4 KV heads (from bundled table (Qwen/Qwen2.5-7B-Instruct)): SGLang's attention stops with a bare AssertionError (assert self.total_num_heads % tp_size == 0, tp_size=8); verl only finds out when it starts the rollout replicas",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1 (valid: 1)",
    ),
    Case(
        "vllm-max-model-len",
        [Q7, "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=65536"],
        'actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=65536: vLLM derives at most 32768 tokens for Qwen/Qwen2.5-7B-Instruct (from bundled table (Qwen/Qwen2.5-7B-Instruct)) and stops with "User-specified max_model_len (65536) is greater than the derived max_model_len (max_position_embeddings=32768 or model_max_length=None in model\'s config.json)." unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set; verl only finds out when it starts the rollout replicas',
        "actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=32768",
    ),
    Case(
        "vllm-expert-parallel",
        [
            Q7,
            "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
            "actor_rollout_ref.rollout.expert_parallel_size=8",
        ],
        'actor_rollout_ref.rollout.expert_parallel_size=8 turns on vLLM\'s expert parallelism, but Qwen/Qwen2.5-7B-Instruct has no experts (from bundled table (Qwen/Qwen2.5-7B-Instruct)): vLLM stops with "Number of experts in the model must be greater than 0 when expert parallelism is enabled."; verl only finds out when it starts the rollout replicas',
        "actor_rollout_ref.rollout.expert_parallel_size=1",
    ),
    Case(
        "sglang-moe-split",
        [
            MX,
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.data_parallel_size=3",
            "actor_rollout_ref.rollout.expert_parallel_size=6",
            "trainer.n_gpus_per_node=6",
        ],
        "actor_rollout_ref.rollout.expert_parallel_size=6 does not divide mistralai/Mixtral-8x7B-v0.1's 8 experts (from bundled table (mistralai/Mixtral-8x7B-v0.1)): SGLang's FusedMoE stops with a bare AssertionError (assert (num_experts - num_shared_slots) % self.moe_ep_size == 0); verl only finds out when it starts the rollout replicas",
        None,
    ),
    Case(
        "sglang-dp-nodes",
        [
            Q7,
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.data_parallel_size=4",
            "trainer.nnodes=2",
        ],
        "actor_rollout_ref.rollout.data_parallel_size=4 makes a replica of 16 GPUs, more than a node's 8: SGLang stops with \"multi-node data parallel is not supported unless dp attention!\" (DP attention is SGLang's enable_dp_attention, set through actor_rollout_ref.rollout.engine_kwargs.sglang); verl only finds out when it starts the rollout replicas",
        "actor_rollout_ref.rollout.data_parallel_size=2 (or 1)",
    ),
    Case(
        "megatron-tp-heads",
        ["model_engine=megatron", Q7, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8"],
        'actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8 does not fit Qwen/Qwen2.5-7B-Instruct (28 attention heads, 4 KV heads, from bundled table (Qwen/Qwen2.5-7B-Instruct)): Megatron\'s TransformerConfig stops with "num_attention_heads (28) must be a multiple of tensor_model_parallel_size (8)."; verl only finds out when the workers build the models',
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 (valid: 1, 2, 4)",
    ),
    Case(
        "megatron-pp-layers",
        [
            "model_engine=megatron",
            Q7,
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=4",
        ],
        'actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 and actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=4 do not split Qwen/Qwen2.5-7B-Instruct\'s 28 layers (from bundled table (Qwen/Qwen2.5-7B-Instruct)): Megatron stops with "num_layers_per_pipeline_rank 14 should be divisible by vp_size 4"; verl only finds out when the workers build the models',
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2 (valid: 2, 7, 14)",
    ),
    Case(
        "megatron-ep-experts",
        [
            "model_engine=megatron",
            MX,
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3",
            "trainer.n_gpus_per_node=6",
        ],
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3 does not fit mistralai/Mixtral-8x7B-v0.1 (8 experts, from bundled table (mistralai/Mixtral-8x7B-v0.1)) on 6 GPUs: Megatron stops with a bare AssertionError in MoELayer (assert self.config.num_moe_experts % ep_size == 0); verl only finds out when the workers build the models",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2 (valid: 1, 2)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule_id}-{i}" for i, c in enumerate(CASES)])
def test_rule_message_and_fix(case: Case) -> None:
    found = [f for f in run_rules(context(case.overrides)) if f.rule_id == case.rule_id]
    assert found, f"{case.rule_id} did not fire"
    assert (found[0].message, found[0].fix) == (case.message, case.fix)
    assert found[0].sources, "a finding names the values it is about and where they came from"


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule_id}-{i}" for i, c in enumerate(CASES)])
def test_first_fix_makes_the_rule_pass(case: Case) -> None:
    if case.fix is None:
        pytest.skip("no size the engine accepts: the finding has no fix")
    after = run_rules(context([*case.overrides, *first_tokens(case.fix)]))
    assert not errors_of(case.rule_id, after), case.fix


ENGINE_OF = {"vllm": "sglang", "sglang": "vllm"}


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.rule_id.split("-")[0] in ENGINE_OF], ids=lambda c: c.rule_id
)
def test_a_rollout_engine_rule_fires_only_for_its_engine(case: Case) -> None:
    engine = case.rule_id.split("-")[0]
    other = [t for t in case.overrides if not t.startswith("actor_rollout_ref.rollout.name=")]
    other.append(f"actor_rollout_ref.rollout.name={ENGINE_OF[engine]}")
    assert not errors_of(case.rule_id, run_rules(context(other)))

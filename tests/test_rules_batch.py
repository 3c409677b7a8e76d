"""Batch, layout, mode, rollout, cluster and verl rules: one row per rule with its exact message and fix."""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recompose import recompose

from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import load_architecture
from verl_safe_launch.rules import RULES, first_tokens, run_rules

BASE = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.name=vllm",
    "trainer.n_gpus_per_node=8",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "ray_kwargs.ray_init.num_cpus=64",
    "critic.ppo_micro_batch_size_per_gpu=2",
]
HARDWARE = HardwareFacts(nodes=4, gpus_per_node=8)
MODULES = ("batch", "cluster", "layout", "modes", "rollout", "verl_static")


def context(overrides: list[str]) -> RuleContext:
    return _context(tuple(overrides))


@functools.lru_cache(maxsize=128)
def _context(overrides: tuple[str, ...]) -> RuleContext:
    view = recompose([*BASE, *overrides]).view
    actor = load_architecture(view.get("actor_rollout_ref.model.path"))
    critic = load_architecture(view.get("critic.model.path"))
    return RuleContext(view, actor, critic, HARDWARE)


def errors_of(rule_id: str, findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.rule_id == rule_id and f.severity is Severity.ERROR]


class Case(NamedTuple):
    rule_id: str
    overrides: list[str]
    message: str
    fix: str | None


CASES = [
    Case(
        "batch-train-divisible-gpus",
        ["data.train_batch_size=63"],
        (
            "data.train_batch_size=63 × rollout.n 4 = 252 sequences per step is not divisible by the 8 GPUs "
            "(= n_gpus_per_node 8 × nnodes 1); verl 0.9.1 stops here in validate_config"
        ),
        "data.train_batch_size=62 (or 64); or actor_rollout_ref.rollout.n=8",
    ),
    Case(
        "batch-megatron-train-divisible",
        [
            "model_engine=megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "data.train_batch_size=63",
        ],
        (
            "data.train_batch_size=63 × rollout.n 4 = 252 sequences per step is not divisible by 4 "
            "data-parallel ranks (8 GPUs / (TP 2 × PP 1 × CP 1)) × ppo_micro_batch_size_per_gpu 2 = 8; verl "
            "0.9.1 stops here in validate_config"
        ),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 (or 3); or data.train_batch_size=62 (or 64)",
    ),
    Case(
        "batch-mini-exceeds-train",
        ["actor_rollout_ref.actor.ppo_mini_batch_size=128"],
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=128 is larger than data.train_batch_size=64: the "
            "actor mini batch cannot hold more prompts than one step; verl 0.9.1 stops here in "
            "ActorConfig.validate"
        ),
        "actor_rollout_ref.actor.ppo_mini_batch_size=64; or data.train_batch_size=128",
    ),
    Case(
        "batch-critic-mini-exceeds-train",
        ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=128"],
        (
            "critic.ppo_mini_batch_size=128 is larger than data.train_batch_size=64: the critic mini batch "
            "cannot hold more prompts than one step; verl 0.9.1 stops here in CriticConfig.validate"
        ),
        "critic.ppo_mini_batch_size=64; or data.train_batch_size=128",
    ),
    Case(
        "batch-mini-per-gpu",
        ["actor_rollout_ref.actor.ppo_mini_batch_size=5"],
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=5 × rollout.n 4 = 20 trajectories per actor mini "
            "batch do not split evenly over 8 data-parallel GPUs; verl 0.9.1 only finds out at the first "
            "training step"
        ),
        "actor_rollout_ref.actor.ppo_mini_batch_size=4 (or 6); or actor_rollout_ref.rollout.n=8",
    ),
    Case(
        "batch-critic-mini-per-gpu",
        ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5"],
        (
            "critic.ppo_mini_batch_size=5 × rollout.n 4 = 20 trajectories per critic mini batch do not split"
            " evenly over 8 data-parallel GPUs; verl 0.9.1 only finds out at the first training step"
        ),
        "critic.ppo_mini_batch_size=4 (or 6); or actor_rollout_ref.rollout.n=8",
    ),
    Case(
        "batch-micro-divides-mini",
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3 does not divide the per-GPU mini batch 8"
            " (= ppo_mini_batch_size 16 × rollout.n 4 / 8 data-parallel GPUs); verl 0.9.1 only finds out at "
            "the first training step"
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 (valid: 1, 2, 4, 8); or "
            "actor_rollout_ref.actor.ppo_mini_batch_size=18 (or 12)"
        ),
    ),
    Case(
        "batch-logprob-micro",
        ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5"],
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5 does not divide the 32 sequences "
            "each data-parallel rank scores in the old log-prob pass (= 256 sequences / 8 data-parallel "
            "GPUs); verl 0.9.1 only finds out at the first training step"
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8, 16, 32); "
            "or data.train_batch_size=66"
        ),
    ),
    Case(
        "batch-ref-logprob-micro",
        ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5"],
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5 does not divide the 32 sequences each"
            " data-parallel rank scores in the reference log-prob pass (= 256 sequences / 8 data-parallel "
            "GPUs); verl 0.9.1 only finds out at the first training step"
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8, 16, 32); or "
            "data.train_batch_size=66"
        ),
    ),
    Case(
        "batch-token-budget",
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
        ],
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512 × sequence split 1 = 512 tokens is less "
            "than the longest sequence 1024 (= max_prompt_length + max_response_length) in the actor update "
            "pass; verl 0.9.1 only finds out at the first training step"
        ),
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024 (or 2048)",
    ),
    Case(
        "verl-actor-micro-keys",
        ["actor_rollout_ref.actor.ppo_micro_batch_size=16"],
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=16 and "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 are both set; verl 0.9.1 stops here in "
            "ActorConfig.__post_init__"
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=null "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 (valid: 1, 2, 4, 8)"
        ),
    ),
    Case(
        "verl-actor-micro-keys",
        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is not set and "
            "actor_rollout_ref.actor.use_dynamic_bsz is false; verl 0.9.1 stops here in "
            "ActorConfig.__post_init__"
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8); or "
            "actor_rollout_ref.actor.use_dynamic_bsz=true"
        ),
    ),
    Case(
        "verl-actor-micro-keys",
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        ],
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=16 is deprecated and "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is not set: verl 0.9.1 accepts this, "
            "then stops with a bare AssertionError when the workers build the actor"
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=null "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 (valid: 1, 2, 4, 8)"
        ),
    ),
    Case(
        "verl-rollout-logprob-micro-keys",
        ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"],
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu is not set and "
            "actor_rollout_ref.actor.use_dynamic_bsz is false; verl 0.9.1 stops here in validate_config"
        ),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8, 16, 32); "
            "or actor_rollout_ref.actor.use_dynamic_bsz=true"
        ),
    ),
    Case(
        "verl-ref-logprob-micro-keys",
        ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null"],
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is not set and "
            "actor_rollout_ref.actor.use_dynamic_bsz is false; verl 0.9.1 stops here in validate_config"
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8, 16, 32); or "
            "actor_rollout_ref.actor.use_dynamic_bsz=true"
        ),
    ),
    Case(
        "verl-critic-micro-keys",
        ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=8"],
        (
            "critic.ppo_micro_batch_size=8 and critic.ppo_micro_batch_size_per_gpu=2 are both set; verl "
            "0.9.1 stops here in CriticConfig.__post_init__"
        ),
        "critic.ppo_micro_batch_size=null critic.ppo_micro_batch_size_per_gpu=2 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "verl-dynamic-bsz-mismatch",
        ["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true"],
        (
            "actor_rollout_ref.actor.use_dynamic_bsz=false but "
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true: verl 0.9.1 accepts this, then "
            "stops with a bare AssertionError when the workers build the actor"
        ),
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
    ),
    Case(
        "verl-actor-deprecated-micro",
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        ],
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=16 is not divisible by the deprecated "
            "actor_rollout_ref.actor.ppo_micro_batch_size=3; verl 0.9.1 stops here in ActorConfig.validate"
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=null "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8)"
        ),
    ),
    Case(
        "verl-critic-deprecated-micro",
        [
            "algorithm.adv_estimator=gae",
            "critic.ppo_micro_batch_size=3",
            "critic.ppo_micro_batch_size_per_gpu=null",
        ],
        (
            "critic.ppo_mini_batch_size=16 is not divisible by the deprecated critic.ppo_micro_batch_size=3;"
            " verl 0.9.1 stops here in CriticConfig.__post_init__"
        ),
        "critic.ppo_micro_batch_size=null critic.ppo_micro_batch_size_per_gpu=4 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "verl-loss-agg-mode",
        ["actor_rollout_ref.actor.loss_agg_mode=foo"],
        (
            "actor_rollout_ref.actor.loss_agg_mode=foo is not a loss aggregation mode verl 0.9.1 knows "
            "(token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm); verl"
            " 0.9.1 stops here in ActorConfig.__post_init__"
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=token-mean (or token-sum, seq-mean-token-sum, "
            "seq-mean-token-mean, seq-mean-token-sum-norm)"
        ),
    ),
    Case(
        "verl-val-temperature",
        ["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.temperature=0"],
        (
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true needs actor_rollout_ref.rollout.temperature"
            " > 0, but it is 0; verl 0.9.1 stops here in validate_config"
        ),
        "actor_rollout_ref.rollout.temperature=1.0; or actor_rollout_ref.rollout.val_kwargs.do_sample=false",
    ),
    Case(
        "verl-lora-rank",
        ["actor_rollout_ref.model.lora_rank=1024"],
        (
            "actor_rollout_ref.model.lora_rank=1024 is above vLLM's largest LoRA rank 512; verl 0.9.1 stops "
            "here in validate_config"
        ),
        "actor_rollout_ref.model.lora_rank=512 (or 256)",
    ),
    Case(
        "verl-router-replay",
        [
            "model_engine=megatron",
            "actor_rollout_ref.actor.megatron.router_replay.mode=R2",
            "algorithm.rollout_correction.bypass_mode=true",
        ],
        (
            "actor_rollout_ref.actor.megatron.router_replay.mode=R2 records routes while recomputing old "
            "log-probs, which algorithm.rollout_correction.bypass_mode=true skips; verl 0.9.1 stops here in "
            "_validate_router_replay_config"
        ),
        (
            "algorithm.rollout_correction.bypass_mode=false; or "
            "actor_rollout_ref.actor.megatron.router_replay.mode=R3"
        ),
    ),
    Case(
        "verl-strategy",
        ["actor_rollout_ref.actor.fsdp_config.strategy=megatron"],
        (
            "actor_rollout_ref.actor.fsdp_config.strategy=megatron does not fit model_engine=dp (expects "
            "fsdp, fsdp2, fsdp_turbo); verl 0.9.1 stops here"
        ),
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp (or fsdp2, fsdp_turbo); or model_engine=megatron",
    ),
    Case(
        "verl-megatron-engine",
        ["model_engine=megatron", "actor_rollout_ref.actor.megatron.dtype=float32"],
        (
            "actor_rollout_ref.actor.megatron.dtype=float32 is not supported by Megatron (bfloat16, "
            "float16); verl 0.9.1 stops here in McoreEngineConfig.__post_init__"
        ),
        "actor_rollout_ref.actor.megatron.dtype=bfloat16 (or float16)",
    ),
    Case(
        "verl-rollout-name",
        ["actor_rollout_ref.rollout.name=foo"],
        (
            "actor_rollout_ref.rollout.name is foo, which is not a rollout backend: verl 0.9.1 has "
            "vllm, sglang and trtllm, and only looks it up after Ray is up"
        ),
        "actor_rollout_ref.rollout.name=vllm (or sglang, trtllm)",
    ),
    Case(
        "verl-rollout-config",
        ["actor_rollout_ref.rollout.mode=sync"],
        (
            "actor_rollout_ref.rollout.mode=sync: the sync rollout mode has been removed; verl 0.9.1 "
            "stops when the workers build the rollout"
        ),
        "actor_rollout_ref.rollout.mode=async",
    ),
    Case(
        "verl-trainer-mode",
        ["trainer.v1.trainer_mode=foo"],
        (
            "trainer.v1.trainer_mode=foo is not a V1 trainer mode (sync, colocate_async, separate_async); "
            "verl 0.9.1 looks it up inside Ray"
        ),
        "trainer.v1.trainer_mode=sync (or colocate_async, separate_async)",
    ),
    Case(
        "batch-v1-sync-step",
        [
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.separate_async.parameter_sync_step=3",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ],
        (
            "data.train_batch_size=64 is not divisible by trainer.v1.separate_async.parameter_sync_step=3; "
            "verl 0.9.1 stops at the first training step"
        ),
        (
            "data.train_batch_size=63 (or 66); or trainer.v1.separate_async.parameter_sync_step=2 "
            "(valid: 1, 2, 4, 8, 16, 32, 64)"
        ),
    ),
    Case(
        "batch-v1-separate-async",
        [
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.separate_async.parameter_sync_step=2",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ],
        (
            "data.train_batch_size=64 must equal parameter_sync_step 2 × ppo_mini_batch_size 16 = 32 in "
            "separate_async mode; verl 0.9.1 stops when the trainer starts"
        ),
        (
            "data.train_batch_size=32; or actor_rollout_ref.actor.ppo_mini_batch_size=32; or "
            "trainer.v1.separate_async.parameter_sync_step=4"
        ),
    ),
    Case(
        "layout-separate-async-pool",
        [
            "trainer.v1.trainer_mode=separate_async",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "trainer.v1.separate_async.parameter_sync_step=4",
        ],
        (
            "actor_rollout_ref.rollout.nnodes=0: separate_async runs the rollout on its own pool, which "
            "needs nnodes > 0; verl 0.9.1 stops when the trainer starts"
        ),
        "actor_rollout_ref.rollout.nnodes=1",
    ),
    Case(
        "batch-gen-batch-size",
        ["data.gen_batch_size=48"],
        (
            "data.train_batch_size=64 is not a multiple of data.gen_batch_size=48: verl fetches prompts in "
            "whole gen_batch_size chunks; verl 0.9.1 stops at the first training step"
        ),
        "data.gen_batch_size=32 (valid: 1, 2, 4, 8, 16, 32, 64); or data.train_batch_size=48 (or 96)",
    ),
    Case(
        "batch-v0-agent-chunks",
        ["trainer.use_v1=false", "actor_rollout_ref.rollout.agent.num_workers=3"],
        (
            "actor_rollout_ref.rollout.agent.num_workers=3 does not divide the 256 sequences per step (= "
            "train_batch_size 64 × rollout.n 4) that the legacy trainer splits over its agent workers; verl "
            "0.9.1 stops at the first training step"
        ),
        (
            "actor_rollout_ref.rollout.agent.num_workers=2 (valid: 1, 2, 4, 8, 16, 32, 64, 128, 256); "
            "or data.train_batch_size=63 (or 66)"
        ),
    ),
    Case(
        "layout-megatron-gpus",
        ["model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
        (
            "the 8 GPUs are not divisible by the actor's tensor × pipeline × context parallel = 3 × 1 × 1 = "
            "3; verl 0.9.1 stops before training"
        ),
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "layout-megatron-vpp",
        [
            "model_engine=megatron",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        ],
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 splits the 16 sequences per "
            "data-parallel rank of the actor update pass into 1 micro batches, not a multiple of the "
            "virtual-pipeline group size 2; verl 0.9.1 only finds out at the first training step"
        ),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "layout-ulysses-gpus",
        ["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3"],
        (
            "actor Ulysses sequence parallel size 3 does not divide the 8 GPUs; verl 0.9.1 only finds out "
            "when the workers build the models"
        ),
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "layout-ulysses-heads",
        [
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=8",
        ],
        (
            "actor Ulysses sequence parallel size 8 does not fit Qwen/Qwen2.5-7B-Instruct: 28 attention "
            "heads and 4 KV heads (from bundled table (Qwen/Qwen2.5-7B-Instruct)) must each divide by it (KV"
            " heads may instead divide it); verl 0.9.1 only finds out when the workers build the models"
        ),
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4 (valid: 1, 2, 4)",
    ),
    Case(
        "layout-ulysses-heads",
        [
            "actor_rollout_ref.model.path=/nonexistent/my-model",
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
        ],
        (
            "skipped: no config.json found for actor_rollout_ref.model.path=/nonexistent/my-model, so "
            "the heads cannot be checked"
        ),
        None,
    ),
    Case(
        "verl-sp-remove-padding",
        [
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.model.use_remove_padding=false",
        ],
        (
            "actor Ulysses sequence parallel size 2 needs actor_rollout_ref.model.use_remove_padding=true, "
            "but it is false; verl 0.9.1 stops here in FSDPActorConfig.validate (or when the workers start)"
        ),
        (
            "actor_rollout_ref.model.use_remove_padding=true; or "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"
        ),
    ),
    Case(
        "layout-rollout-world",
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
        (
            "rollout tensor × data × pipeline parallel = 3 × 1 × 1 = 3 GPUs per replica does not divide the "
            "8 GPUs of the trainer pool; verl 0.9.1 only finds out after the actor is loaded on the GPUs"
        ),
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "layout-rollout-nodes",
        ["trainer.nnodes=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=12"],
        (
            "rollout tensor × data × pipeline parallel = 12 × 1 × 1 = 12 GPUs per replica spans nodes of 8 "
            "GPUs unevenly (12 is not a multiple of 8); verl 0.9.1 only finds out when it starts the rollout"
            " replicas"
        ),
        "actor_rollout_ref.rollout.tensor_model_parallel_size=8 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "layout-rollout-vllm-dp",
        [
            "trainer.nnodes=3",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
            "actor_rollout_ref.rollout.data_parallel_size=4",
        ],
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3 does not divide the 8 GPUs a vLLM "
            "data-parallel replica has per node; verl 0.9.1 only finds out when it starts the rollout "
            "replicas"
        ),
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 (valid: 1, 2, 4, 8)",
    ),
    Case(
        "layout-rollout-pp",
        ["actor_rollout_ref.rollout.pipeline_model_parallel_size=2"],
        (
            "actor_rollout_ref.rollout.pipeline_model_parallel_size=2: rollout vllm does not implement "
            "pipeline parallel; verl 0.9.1 only finds out after the actor is loaded on the GPUs"
        ),
        "actor_rollout_ref.rollout.pipeline_model_parallel_size=1",
    ),
    Case(
        "layout-rollout-ep",
        ["actor_rollout_ref.rollout.expert_parallel_size=4"],
        (
            "actor_rollout_ref.rollout.expert_parallel_size=4 must equal rollout tensor × data parallel = 2 "
            "× 1 = 2; verl 0.9.1 only finds out after the actor is loaded on the GPUs"
        ),
        "actor_rollout_ref.rollout.expert_parallel_size=2 (or 1)",
    ),
    Case(
        "layout-rollout-max-model-len",
        [
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
            "actor_rollout_ref.rollout.max_model_len=100000",
        ],
        (
            "actor_rollout_ref.rollout.max_model_len=100000 exceeds Qwen/Qwen2.5-7B-Instruct's "
            "max_position_embeddings 32768 (from bundled table (Qwen/Qwen2.5-7B-Instruct)); verl 0.9.1 only "
            "finds out when it starts the rollout replicas"
        ),
        "actor_rollout_ref.rollout.max_model_len=32768",
    ),
    Case(
        "layout-reward-pool",
        ["reward.reward_model.enable_resource_pool=true", "reward.reward_model.n_gpus_per_node=0"],
        (
            "reward.reward_model.n_gpus_per_node=0: reward.reward_model.enable_resource_pool=true needs its "
            "own GPU pool, so n_gpus_per_node must be > 0; verl 0.9.1 only finds out when it builds the "
            "resource pools"
        ),
        "reward.reward_model.n_gpus_per_node=8",
    ),
    Case(
        "layout-teacher-pool",
        ["distillation.enabled=true"],
        (
            "distillation.nnodes=0: distillation needs its own GPU pool, so nnodes must be > 0; verl 0.9.1 "
            "only finds out when it builds the resource pools"
        ),
        "distillation.nnodes=1",
    ),
    Case(
        "layout-gpus-available",
        ["trainer.nnodes=5"],
        (
            "the run asks Ray for 40 GPUs (trainer and extra pools) but the machines have 32 (4 × 8); verl "
            "0.9.1 only finds out when it builds the resource pools"
        ),
        "trainer.nnodes=4; or trainer.n_gpus_per_node=6",
    ),
    Case(
        "layout-ray-cpus",
        ["ray_kwargs.ray_init.num_cpus=4"],
        (
            "ray_kwargs.ray_init.num_cpus=4 is below the 34 logical CPUs the V1 trainer reserves (GPU "
            "bundles 24 + TransferQueue 9 + scheduling 1); the TransferQueue start-up then waits "
            "forever without an error"
        ),
        "ray_kwargs.ray_init.num_cpus=34",
    ),
    Case(
        "layout-ray-cpus",
        ["ray_kwargs.ray_init.num_cpus=null"],
        (
            "skipped: ray_kwargs.ray_init.num_cpus is null, so Ray counts the machine's CPUs; the V1 "
            "trainer needs 34 (GPU bundles 24 + TransferQueue 9 + scheduling 1); declare "
            "hardware.cpus_per_node to check it"
        ),
        None,
    ),
    Case(
        "batch-train-divisible-gpus",
        ["data.train_batch_size=abc"],
        "skipped: data.train_batch_size=abc is not a positive integer",
        None,
    ),
]


def test_base_config_is_clean() -> None:
    # verl's placeholder data paths do not exist here: the data rules name them, nothing else fires
    assert {f.rule_id for f in run_rules(context([]))} <= {"data-files-missing"}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule_id}-{i}" for i, c in enumerate(CASES)])
def test_rule_message_and_fix(case: Case) -> None:
    found = [f for f in run_rules(context(case.overrides)) if f.rule_id == case.rule_id]
    assert found, f"{case.rule_id} did not fire"
    assert (found[0].message, found[0].fix) == (case.message, case.fix)
    assert found[0].sources, "a finding names the values it is about and where they came from"


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.fix], ids=[f"{c.rule_id}-{i}" for i, c in enumerate(CASES) if c.fix]
)
def test_first_fix_makes_the_rule_pass(case: Case) -> None:
    before = errors_of(case.rule_id, run_rules(context(case.overrides)))
    after = errors_of(case.rule_id, run_rules(context([*case.overrides, *first_tokens(before[0].fix or "")])))
    assert before[0].keys not in [f.keys for f in after]


def test_every_rule_has_a_row() -> None:
    ours = {r.rule_id for r in RULES if r.check.__module__.rsplit(".", 1)[-1] in MODULES}
    assert ours == {c.rule_id for c in CASES}
    assert len([r.rule_id for r in RULES]) == len({r.rule_id for r in RULES}), "rule ids are unique"


BATCH_KEYS = st.fixed_dictionaries(
    {
        "trainer.n_gpus_per_node": st.sampled_from([1, 2, 4, 6, 8]),
        "data.train_batch_size": st.integers(1, 96),
        "actor_rollout_ref.rollout.n": st.integers(1, 12),
        "actor_rollout_ref.actor.ppo_mini_batch_size": st.integers(1, 96),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": st.integers(1, 16),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": st.integers(1, 16),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": st.integers(1, 16),
        "actor_rollout_ref.rollout.tensor_model_parallel_size": st.sampled_from([1, 2, 3, 4, 8]),
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": st.sampled_from([1, 2, 3, 4]),
        "algorithm.adv_estimator": st.sampled_from(["grpo", "gae"]),
    }
)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BATCH_KEYS)
def test_first_fix_makes_the_rule_pass_for_generated_configs(values: dict[str, object]) -> None:
    overrides = [f"{k}={v}" for k, v in values.items()]
    for finding in [f for f in run_rules(context(overrides)) if f.severity is Severity.ERROR and f.fix]:
        fixed = run_rules(context([*overrides, *first_tokens(finding.fix or "")]))
        assert finding.keys not in [f.keys for f in errors_of(finding.rule_id, fixed)], finding.fix

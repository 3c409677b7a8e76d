"""The frozen batch arithmetic: golden cases, every role's data-parallel size, padding, unknown inputs."""

from __future__ import annotations

import pytest
from recompose import recompose

from verl_safe_launch.rules import BatchPlan, batch_plan, exact, lcm, pos_int, round_up, with_values

GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm"]


def plan(*overrides: str) -> BatchPlan:
    return batch_plan(recompose([*GRPO, *overrides]).view)


def test_six_gpu_example() -> None:
    from pathlib import Path

    from conftest import EXAMPLES

    from verl_safe_launch.compose import compose
    from verl_safe_launch.inputs import ComposeRequest

    view = compose(ComposeRequest(config_files=(Path(EXAMPLES / "grpo_6gpu.yaml"),))).view
    p = batch_plan(view)
    assert (p.prompts, p.trajectories, p.gpus, p.replicas) == (60, 720, 6, 3)
    assert (p.prompts_per_replica, p.sequences_per_replica) == (20, 240)
    assert (p.mini_per_gpu, p.grad_accum, p.logprob_micro_batches, p.ref_micro_batches) == (120, 15, 15, 15)
    assert (p.pad_multiple, p.padded, p.padding, p.optimizer_steps) == (720, 720, 0, 1)


def test_ulysses_cluster() -> None:
    p = plan(
        "trainer.nnodes=4",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=128",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    )
    assert (p.gpus, p.actor.sp, p.actor.dp, p.replicas, p.sequences_per_replica) == (32, 4, 8, 16, 64)
    assert (p.mini_per_gpu, p.grad_accum, p.logprob_rows, p.logprob_micro_batches) == (128, 16, 128, 32)


def test_legacy_ulysses_key_wins_when_above_one() -> None:
    p = plan(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
    )
    assert (p.actor.sp, p.actor.dp, p.ref.sp) == (2, 4, 2)


def test_megatron_data_parallel() -> None:
    p = plan(
        "model_engine=megatron",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    )
    assert (p.actor.engine, p.actor.model_parallel, p.actor.dp, p.ref.dp) == ("megatron", 4, 2, 2)


def test_megatron_dynamic_context_parallel_has_one_rank() -> None:
    p = plan(
        "model_engine=megatron",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
        "actor_rollout_ref.actor.megatron.dynamic_context_parallel=true",
    )
    assert p.actor.dp == 1


def test_padding_includes_the_critic_mini_batch() -> None:
    p = batch_plan(
        recompose(
            [
                "algorithm.adv_estimator=gae",
                "data.train_batch_size=100",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                "critic.ppo_mini_batch_size=48",
            ]
        ).view
    )
    assert p.use_critic and (p.mini_trajectories, p.critic_mini_trajectories) == (64, 96)
    assert (p.pad_multiple, p.step_trajectories, p.padded, p.padding) == (192, 200, 384, 184)
    assert (p.mini_batches, p.optimizer_steps) == (6, 6)


def test_separate_async_pads_each_local_update() -> None:
    p = plan(
        "trainer.v1.trainer_mode=separate_async",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=4",
    )
    assert (p.sync_steps, p.step_prompts, p.step_trajectories, p.padded) == (4, 16, 64, 64)
    assert (p.optimizer_steps, p.rollout_gpus, p.replicas) == (4, 4, 2)


def test_legacy_trainer_does_not_pad() -> None:
    p = plan("trainer.use_v1=false", "data.train_batch_size=60", "actor_rollout_ref.rollout.n=2")
    assert (p.v1, p.trainer_mode, p.pad_multiple, p.padded) == (False, "v0", 8, 120)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.train_batch_size=abc", "trajectories"),
        ("data.train_batch_size=0", "trajectories"),
        ("actor_rollout_ref.rollout.n=4.0", "mini_trajectories"),
        ("trainer.n_gpus_per_node=7", "mini_per_gpu"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7", "grad_accum"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size=3", "replicas"),
        ("actor_rollout_ref.actor.strategy=veomni", "mini_per_gpu"),
    ],
)
def test_unknown_or_uneven_inputs_give_none(override: str, field: str) -> None:
    p = plan("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", override)
    assert getattr(p, field) is None


def test_with_values_moves_interpolating_followers() -> None:
    view = recompose(GRPO).view
    changed = with_values(view, {"actor_rollout_ref.actor.ppo_mini_batch_size": 8})
    assert changed.get("critic.ppo_mini_batch_size") == 8
    assert view.get("critic.ppo_mini_batch_size") == 256


@pytest.mark.parametrize(
    ("fn", "args", "expected"),
    [
        (pos_int, (True,), None),
        (pos_int, (-1,), None),
        (pos_int, (3,), 3),
        (exact, (10, 3), None),
        (exact, (12, 3), 4),
        (exact, (12, 0), None),
        (lcm, (6, 720, None), None),
        (lcm, (8, 48, 96), 96),
        (round_up, (200, 192), 384),
        (round_up, (None, 8), None),
    ],
)
def test_helpers(fn: object, args: tuple[object, ...], expected: object) -> None:
    assert fn(*args) == expected  # type: ignore[operator]

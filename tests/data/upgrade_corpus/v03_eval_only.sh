#!/usr/bin/env bash
# expect-release: 0.3
# Evaluation only: a checkpoint is validated, never trained (the keys were appended with '+' in this release).
set -x
CKPT=/ckpt/global_step_200/actor/huggingface

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=/data/math/train.parquet \
    data.val_files=/data/math/test.parquet \
    data.train_batch_size=64 \
    data.max_prompt_length=1024 \
    data.max_response_length=4096 \
    actor_rollout_ref.model.path=$CKPT \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    custom_reward_function.path=./reward/math.py \
    +trainer.val_only=True \
    +trainer.val_before_train=True \
    trainer.logger=['console'] \
    trainer.n_gpus_per_node=4 \
    trainer.nnodes=1

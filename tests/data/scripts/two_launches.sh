#!/bin/bash
# Two runs from one file: a short smoke test, then the real run with a user config file.
set -e
HERE=/data/configs
COMMON="algorithm.adv_estimator=grpo actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.rollout.name=vllm"

python3 -m verl.trainer.main_ppo $COMMON \
    data.train_batch_size=16 actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
    trainer.total_training_steps=2 \
    trainer.n_gpus_per_node=2

python -m verl.trainer.main_ppo $COMMON \
    data.train_batch_size=256 actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    ++trainer.remove_previous_ckpt_in_save=True \
    +actor_rollout_ref.actor.ppo_infer_micro_batch_size_per_gpu=16 \
    ++trainer.my_custom_flag=1 \
    trainer.n_gpus_per_node=8 2>&1 | tee run.log

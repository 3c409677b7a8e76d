#!/usr/bin/env bash
# expect-release: 0.2
# A multi-turn agent project built on a vendored verl 0.2: the group size is the project's own n_agent, and the
# environment settings sit beside verl's keys in its own YAML.
set -x

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=/data/sokoban/train.parquet \
    data.val_files=/data/sokoban/test.parquet \
    data.train_batch_size=32 \
    data.max_prompt_length=4096 \
    data.max_response_length=400 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.rollout.n_agent=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    reward_model.reward_manager=naive \
    env.name=sokoban \
    env.max_turns=5 \
    env.dim_room=[6,6] \
    trainer.val_generations_to_log_to_wandb=4 \
    trainer.logger=['console','wandb'] \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=10

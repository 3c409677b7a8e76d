#!/usr/bin/env bash
# expect-release: 0.2
# PPO with a model-based reward (reward_model.*, the top-level section of the time) and Ulysses SP 4 on the critic.
set -x

python3 -m verl.trainer.main_ppo \
    data.train_files=/data/hh/train.parquet \
    data.val_files=/data/hh/test.parquet \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    critic.model.path=Qwen/Qwen2.5-3B-Instruct \
    critic.model.use_remove_padding=True \
    critic.ppo_micro_batch_size=32 \
    critic.ulysses_sequence_parallel_size=4 \
    reward_model.enable=True \
    reward_model.model.path=OpenRLHF/Llama-3-8b-rm-mixture \
    reward_model.micro_batch_size=16 \
    trainer.val_generations_to_log_to_wandb=8 \
    trainer.logger=['console','wandb'] \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=2 \
    trainer.total_epochs=3

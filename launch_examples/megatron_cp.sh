#!/bin/bash
# A megatron recipe whose context-parallel words depend on $CP from the environment; the part every branch
# shares forgets the reference model's log-prob micro batch.
set -x
if [ -n "$CP" ]; then
    CP_ARGS="actor_rollout_ref.actor.megatron.context_parallel_size=$CP actor_rollout_ref.ref.megatron.context_parallel_size=$CP"
else
    CP_ARGS=""
fi

python3 -m verl.trainer.main_ppo \
    model_engine=megatron \
    $CP_ARGS \
    algorithm.adv_estimator=grpo \
    data.train_files=launch_examples/data/train.parquet \
    data.val_files=launch_examples/data/train.parquet \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.n=4 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 "$@"

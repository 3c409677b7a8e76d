#!/usr/bin/env bash
# PPO | text | vLLM rollout | Megatron training: parameters kept in bash arrays.
set -xeuo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1

# ---- user-adjustable ----
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-$MODEL_PATH}
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
train_batch_size=${TRAIN_BATCH_SIZE:-1024}
ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE:-256}
ppo_max_token_len_per_gpu=${PPO_MAX_TOKEN_LEN_PER_GPU:-24576}
actor_tp=${ACTOR_TP:-2}
actor_pp=${ACTOR_PP:-2}
rollout_tp=${ROLLOUT_TP:-2}

DATA=(
    algorithm.adv_estimator=gae
    data.train_files=/data/gsm8k/train.parquet
    data.val_files=/data/gsm8k/test.parquet
    data.train_batch_size=${train_batch_size}
    data.max_prompt_length=1024
    data.max_response_length=2048
)

ACTOR=(
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=${ppo_mini_batch_size}
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${ppo_max_token_len_per_gpu}
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${actor_tp}
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=${actor_pp}
)

ROLLOUT=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=${rollout_tp}
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${ppo_max_token_len_per_gpu}
)

CRITIC=(
    critic.model.path="$CRITIC_MODEL_PATH"
    critic.optim.lr=1e-5
    critic.ppo_max_token_len_per_gpu=${ppo_max_token_len_per_gpu}
    critic.megatron.tensor_model_parallel_size=${actor_tp}
)

TRAINER=(
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.n_gpus_per_node=${NGPUS_PER_NODE}
    trainer.nnodes=${NNODES}
    trainer.total_epochs=15
)

LAUNCH=(python3)
if [ "${VERL_USE_UV:-1}" != 0 ]; then
    LAUNCH=(uv run --frozen --no-sync python3)
fi
"${LAUNCH[@]}" -m verl.trainer.main_ppo \
    "${DATA[@]}" \
    "${ACTOR[@]}" \
    "${ROLLOUT[@]}" \
    "${CRITIC[@]}" \
    "${TRAINER[@]}" \
    model_engine=megatron \
    "$@"

# Copyright 2024 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
Metrics related to the PPO trainer.
"""

import logging
from collections import defaultdict
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

import verl.utils.torch_functional as verl_F
from verl import DataProto
from verl.utils.fs import copy_to_local
from verl.utils.import_utils import deprecated
from verl.utils.model import update_model_config

logger = logging.getLogger(__name__)

_NUM_LOCAL_EXPERTS_MODEL_TYPES = {"gpt_oss", "mixtral"}


@deprecated("verl.utils.metric.reduce_metrics")
def reduce_metrics(metrics: dict[str, list[Any]]) -> dict[str, Any]:
    """
    Reduces a dictionary of metric lists by computing the mean of each list.

    Args:
        metrics: A dictionary mapping metric names to lists of metric values.

    Returns:
        A dictionary with the same keys but with each list replaced by its mean value.

    Example:
        >>> metrics = {"loss": [1.0, 2.0, 3.0], "accuracy": [0.8, 0.9, 0.7]}
        >>> reduce_metrics(metrics)
        {"loss": 2.0, "accuracy": 0.8}
    """
    from verl.utils.metric import reduce_metrics

    return reduce_metrics(metrics)


def _compute_response_info(batch: DataProto) -> dict[str, Any]:
    """
    Computes information about prompts and responses from a batch.

    This is an internal helper function that extracts masks and lengths for prompts and responses.

    Args:
        batch: A DataProto object containing batch data with responses and attention masks.

    Returns:
        A dictionary containing:
            - response_mask: Attention mask for the response tokens
            - prompt_length: Tensor of prompt lengths for each item in the batch
            - response_length: Tensor of response lengths for each item in the batch
    """
    if "prompt_length" in batch.batch and "response_length" in batch.batch:
        return dict(
            prompt_length=batch.batch["prompt_length"],
            response_length=batch.batch["response_length"],
        )

    response_length = batch.batch["responses"].shape[-1]

    prompt_mask = batch.batch["attention_mask"][:, :-response_length]
    response_mask = batch.batch["attention_mask"][:, -response_length:]

    prompt_length = prompt_mask.sum(-1).float()
    response_length = response_mask.sum(-1).float()  # (batch_size,)

    return dict(
        prompt_length=prompt_length,
        response_length=response_length,
    )


def _get_nested_attr(obj: Any, name: str) -> Any:
    if hasattr(obj, "get"):
        return obj.get(name)
    return getattr(obj, name, None)


def get_hf_config_override_kwargs(override_config: Any) -> dict[str, Any]:
    if isinstance(override_config, DictConfig):
        override_config = OmegaConf.to_container(override_config, resolve=True)
    if not override_config:
        return {}
    if "model_config" in override_config:
        return override_config["model_config"]
    return override_config


def _get_config_value(config: Any, key: str, default: Any = None) -> Any:
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def infer_moe_num_experts(model_config: Any) -> int | None:
    """Infer the global number of routed experts from an in-memory config-like object."""
    candidates = [model_config]
    hf_config = _get_nested_attr(model_config, "hf_config")
    text_config = _get_nested_attr(model_config, "text_config")
    override_config = _get_nested_attr(model_config, "override_config")
    if hf_config is not None:
        candidates.append(hf_config)
        hf_text_config = _get_nested_attr(hf_config, "text_config")
        if hf_text_config is not None:
            candidates.append(hf_text_config)
    if text_config is not None:
        candidates.append(text_config)
    if override_config is not None:
        candidates.append(override_config)
        override_model_config = _get_nested_attr(override_config, "model_config")
        if override_model_config is not None:
            candidates.append(override_model_config)
        override_text_config = _get_nested_attr(override_config, "text_config")
        if override_text_config is not None:
            candidates.append(override_text_config)

    for candidate in candidates:
        for attr in ("num_experts", "n_routed_experts"):
            value = _get_nested_attr(candidate, attr)
            if value is not None:
                return int(value)
        if _get_nested_attr(candidate, "model_type") in _NUM_LOCAL_EXPERTS_MODEL_TYPES:
            value = _get_nested_attr(candidate, "num_local_experts")
            if value is not None:
                return int(value)
    return None


def infer_rollout_moe_num_experts(model_config: Any) -> int | None:
    """Infer rollout MoE num_experts, loading the HF config only when needed."""
    num_experts = infer_moe_num_experts(model_config)
    if num_experts is not None:
        return num_experts

    hf_config_path = (
        _get_config_value(model_config, "local_hf_config_path")
        or _get_config_value(model_config, "hf_config_path")
        or _get_config_value(model_config, "path")
    )
    if hf_config_path is None:
        return None

    local_hf_config_path = copy_to_local(hf_config_path, use_shm=_get_config_value(model_config, "use_shm", False))
    hf_config = AutoConfig.from_pretrained(
        local_hf_config_path,
        trust_remote_code=_get_config_value(model_config, "trust_remote_code", False),
    )
    override_config = get_hf_config_override_kwargs(_get_config_value(model_config, "override_config", {}))
    if override_config:
        update_model_config(hf_config, override_config)
    return infer_moe_num_experts(hf_config)


def _compute_rollout_moe_load_balance_metrics_from_counts(
    load_counts: torch.Tensor | None,
    prefix: str = "rollout/moe",
) -> dict[str, Any]:
    if load_counts is None or load_counts.numel() == 0:
        return {}

    load_matrix = load_counts.float()
    load_matrix = load_matrix / load_matrix.sum(dim=1, keepdim=True).clamp_min(1.0)
    num_experts = load_matrix.shape[1]
    deviation = load_matrix * num_experts - 1.0
    max_vio = deviation.max(dim=1).values
    min_vio = deviation.min(dim=1).values
    avg_vio = deviation.abs().mean(dim=1)

    metrics: dict[str, Any] = {}
    for i in range(load_matrix.shape[0]):
        metrics[f"{prefix}/max_vio/layer_{i}"] = max_vio[i].detach().item()
        metrics[f"{prefix}/min_vio/layer_{i}"] = min_vio[i].detach().item()
        metrics[f"{prefix}/avg_vio/layer_{i}"] = avg_vio[i].detach().item()
    metrics[f"{prefix}/max_vio/max"] = max_vio.max().detach().item()
    metrics[f"{prefix}/max_vio/avg"] = max_vio.mean().detach().item()
    metrics[f"{prefix}/min_vio/max"] = min_vio.max().detach().item()
    metrics[f"{prefix}/min_vio/avg"] = min_vio.mean().detach().item()
    metrics[f"{prefix}/avg_vio/max"] = avg_vio.max().detach().item()
    metrics[f"{prefix}/avg_vio/avg"] = avg_vio.mean().detach().item()
    return metrics


def _compute_rollout_moe_load_counts(
    routed_experts: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    num_experts: int | None,
) -> torch.Tensor | None:
    """Count routed experts in response tokens as [num_layers, num_experts].

    Each sequence's last valid response position is excluded: that token is
    sampled but never fed back through the model, so it carries no routing
    record (its slot is filler, not data).
    """
    if routed_experts is None or response_mask is None or num_experts is None or num_experts <= 0:
        return None
    if routed_experts.dim() != 4:
        logger.warning("Expected routed_experts with shape [bsz, seqlen, layers, topk], got %s", routed_experts.shape)
        return None
    if response_mask.dim() != 2 or response_mask.shape[0] != routed_experts.shape[0]:
        logger.warning(
            "Response mask shape %s is incompatible with routed_experts %s", response_mask.shape, routed_experts.shape
        )
        return None

    response_len = response_mask.shape[1]
    if response_len == 0:
        return None
    if routed_experts.shape[1] < response_len:
        logger.warning(
            "routed_experts sequence length %s is shorter than response length %s",
            routed_experts.shape[1],
            response_len,
        )
        return None

    response_routed_experts = routed_experts[:, -response_len:]
    response_mask = response_mask.to(device=response_routed_experts.device, dtype=torch.bool)
    # The final response token is sampled but never fed back through the model,
    # so it has no routing record; its slot holds filler from batch assembly
    # (zeros, see AgentLoopWorker._postprocess). Counting it would credit
    # expert 0 with num_layers * topk phantom assignments per sequence, so drop
    # each sequence's last valid position. This is the metrics counterpart of
    # build_r3_replay_mask, which skips the same row on the replay side.
    positions = torch.arange(response_len, device=response_mask.device)
    last_valid = torch.where(response_mask, positions, positions.new_full((), -1)).amax(dim=-1)
    has_valid = last_valid >= 0
    is_last_valid = (positions.unsqueeze(0) == last_valid.unsqueeze(1)) & has_valid.unsqueeze(1)
    response_mask = response_mask & ~is_last_valid
    selected = response_routed_experts[response_mask]
    selected = selected.detach().to(device="cpu", dtype=torch.long)
    if selected.numel() == 0:
        return None
    if selected.min() < 0 or selected.max() >= num_experts:
        logger.warning(
            "Skipping rollout MoE load-balance metrics because routed expert ids are outside [0, %s): min=%s max=%s",
            num_experts,
            selected.min().item(),
            selected.max().item(),
        )
        return None

    # selected: [num_response_tokens, num_layers, topk]. Count every top-k slot
    # without materializing a large [tokens, layers, topk, experts] one-hot tensor.
    return torch.stack(
        [
            torch.bincount(selected[:, layer_idx, :].flatten(), minlength=num_experts)
            for layer_idx in range(selected.shape[1])
        ]
    )


def compute_rollout_moe_load_balance_metrics(
    routed_experts: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    num_experts: int | None,
    prefix: str = "rollout/moe",
) -> dict[str, Any]:
    """Compute rollout MoE load-balance metrics from returned routed expert ids."""
    load_counts = _compute_rollout_moe_load_counts(
        routed_experts=routed_experts,
        response_mask=response_mask,
        num_experts=num_experts,
    )
    return _compute_rollout_moe_load_balance_metrics_from_counts(load_counts, prefix=prefix)


def get_metric_data_with_optional_routed_experts(
    keys: list[str],
    partition_id: str,
    fields: list[str],
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: "RolloutMoELoadBalanceMetricsAccumulator",
    kv_batch_get: Callable[..., Any],
):
    if moe_lb_metrics_interval <= 0 or not accumulator.should_request_routed_experts(global_steps):
        return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)

    fields_with_routed_experts = [*fields, "routed_experts"]
    try:
        return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields_with_routed_experts)
    except ValueError as exc:
        if "routed_experts" not in str(exc):
            raise
        accumulator.defer_routed_experts_retry(global_steps, moe_lb_metrics_interval)
        accumulator.warn_skip_once("missing_routed_experts", f"Skipping rollout MoE load-balance metrics: {exc}")
        return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)


def compute_moe_lb_metrics(
    metrics_batch: DataProto,
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: "RolloutMoELoadBalanceMetricsAccumulator",
) -> dict[str, Any]:
    if moe_lb_metrics_interval <= 0:
        return {}

    updated_moe_lb_metrics = accumulator.update(
        routed_experts=metrics_batch.batch.get("routed_experts", None),
        response_mask=metrics_batch.batch.get("response_mask", None),
    )
    if global_steps % moe_lb_metrics_interval != 0:
        return {}

    routed_expert_assignments = accumulator.total_assignments()
    metrics = accumulator.pop_metrics()
    metrics["rollout/moe/routed_experts_found"] = float(routed_expert_assignments > 0)
    metrics["rollout/moe/routed_expert_assignments"] = routed_expert_assignments
    if not updated_moe_lb_metrics and routed_expert_assignments == 0:
        accumulator.warn_skip_once(
            "no_routed_expert_counts",
            "Skipping rollout MoE load-balance metrics because no routed expert counts were found.",
        )
    return metrics


class RolloutMoELoadBalanceMetricsAccumulator:
    """Accumulate rollout MoE routed expert counts across a logging interval."""

    def __init__(self, model_config: Any | None = None):
        self.model_config = model_config
        self.load_counts: torch.Tensor | None = None
        self.num_experts: int | None = None
        self.num_experts_initialized = False
        self.routed_experts_retry_after_step = 0
        self.warned_skip_keys: set[str] = set()

    def should_request_routed_experts(self, global_steps: int) -> bool:
        return global_steps >= self.routed_experts_retry_after_step

    def defer_routed_experts_retry(self, global_steps: int, interval: int) -> None:
        self.routed_experts_retry_after_step = global_steps + max(interval, 1)

    def _infer_num_experts(self) -> int | None:
        if self.num_experts_initialized:
            return self.num_experts

        if self.model_config is not None:
            try:
                self.num_experts = infer_rollout_moe_num_experts(self.model_config)
            except Exception as exc:
                self.warn_skip_once(
                    "num_experts_exception", f"Failed to infer rollout MoE num_experts from model config: {exc}"
                )

        self.num_experts_initialized = True
        if self.num_experts is None:
            self.warn_skip_once(
                "num_experts_missing",
                "Skipping rollout MoE load-balance metrics because num_experts could not be inferred "
                "from actor_rollout_ref.model or the Hugging Face config.",
            )
        return self.num_experts

    def warn_skip_once(self, key: str, message: str) -> None:
        if key in self.warned_skip_keys:
            return
        logger.warning(message)
        self.warned_skip_keys.add(key)

    def update(
        self,
        routed_experts: torch.Tensor | None,
        response_mask: torch.Tensor | None,
        num_experts: int | None = None,
    ) -> bool:
        if num_experts is None:
            num_experts = self._infer_num_experts()
        load_counts = _compute_rollout_moe_load_counts(
            routed_experts=routed_experts,
            response_mask=response_mask,
            num_experts=num_experts,
        )
        if load_counts is None:
            return False
        if self.load_counts is None:
            self.load_counts = load_counts
        elif self.load_counts.shape == load_counts.shape:
            self.load_counts += load_counts
        else:
            logger.warning(
                "Resetting rollout MoE load-balance accumulator because count shape changed from %s to %s",
                self.load_counts.shape,
                load_counts.shape,
            )
            self.load_counts = load_counts
        return True

    def compute(self, prefix: str = "rollout/moe") -> dict[str, Any]:
        return _compute_rollout_moe_load_balance_metrics_from_counts(self.load_counts, prefix=prefix)

    def total_assignments(self) -> int:
        if self.load_counts is None:
            return 0
        return int(self.load_counts.sum().item())

    def reset(self) -> None:
        self.load_counts = None

    def pop_metrics(self, prefix: str = "rollout/moe") -> dict[str, Any]:
        metrics = self.compute(prefix=prefix)
        self.reset()
        return metrics


def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict[str, Any]:
    """
    Computes various metrics from a batch of data for PPO training.

    This function calculates metrics related to scores, rewards, advantages, returns, values,
    and sequence lengths from a batch of data. It provides statistical information (mean, max, min)
    for each metric category.

    Args:
        batch: A DataProto object containing batch data with token-level scores, rewards, advantages, etc.
        use_critic: Whether to include critic-specific metrics. Defaults to True.

    Returns:
        A dictionary of metrics including:
            - critic/score/mean, max, min: Statistics about sequence scores
            - critic/rewards/mean, max, min: Statistics about sequence rewards
            - critic/advantages/mean, max, min: Statistics about advantages
            - critic/returns/mean, max, min: Statistics about returns
            - critic/values/mean, max, min: Statistics about critic values (if use_critic=True)
            - critic/vf_explained_var: Explained variance of the value function (if use_critic=True)
            - response_length/mean, max, min, clip_ratio: Statistics about response lengths
            - prompt_length/mean, max, min, clip_ratio: Statistics about prompt lengths
            - num_turns/mean, max, min: Statistics about the number of multi-turn conversations
    """
    sequence_score = batch.batch["token_level_scores"].sum(-1)
    sequence_reward = batch.batch["token_level_rewards"].sum(-1)

    advantages = batch.batch["advantages"]
    returns = batch.batch["returns"]

    max_prompt_length = batch.batch["prompts"].shape[-1]
    max_response_length = batch.batch["responses"].shape[-1]

    response_mask = batch.batch["response_mask"].bool()

    response_info = _compute_response_info(batch)
    prompt_length = response_info["prompt_length"]
    response_length = response_info["response_length"]

    aborted_mask = (response_length == 0).bool()
    non_aborted_mask = ~aborted_mask

    non_aborted_sequence_score = sequence_score[non_aborted_mask]
    non_aborted_sequence_reward = sequence_reward[non_aborted_mask]

    if non_aborted_sequence_score.numel() > 0:
        score_mean = torch.mean(non_aborted_sequence_score).detach().item()
        score_max = torch.max(non_aborted_sequence_score).detach().item()
        score_min = torch.min(non_aborted_sequence_score).detach().item()
    else:
        logger.warning("All samples are aborted, returning default score metrics")
        score_mean = score_max = score_min = float("nan")

    if non_aborted_sequence_reward.numel() > 0:
        reward_mean = torch.mean(non_aborted_sequence_reward).detach().item()
        reward_max = torch.max(non_aborted_sequence_reward).detach().item()
        reward_min = torch.min(non_aborted_sequence_reward).detach().item()
    else:
        logger.warning("All samples are aborted, returning default reward metrics")
        reward_mean = reward_max = reward_min = float("nan")

    valid_adv = torch.masked_select(advantages, response_mask)
    valid_returns = torch.masked_select(returns, response_mask)

    if valid_adv.numel() > 0:
        adv_mean = torch.mean(valid_adv).detach().item()
        adv_max = torch.max(valid_adv).detach().item()
        adv_min = torch.min(valid_adv).detach().item()
    else:
        logger.warning("Response mask is all False, returning default advantage metrics")
        adv_mean = adv_max = adv_min = float("nan")

    if valid_returns.numel() > 0:
        returns_mean = torch.mean(valid_returns).detach().item()
        returns_max = torch.max(valid_returns).detach().item()
        returns_min = torch.min(valid_returns).detach().item()
    else:
        logger.warning("Response mask is all False, returning default return metrics")
        returns_mean = returns_max = returns_min = float("nan")

    # Aborted samples and non-aborted response length statistics
    # response_length_non_aborted/*: statistics computed on non-aborted samples only
    aborted_ratio = torch.mean(aborted_mask.float()).detach().item()

    non_aborted_response_length = response_length[non_aborted_mask]
    if non_aborted_response_length.numel() > 0:
        non_aborted_response_length_mean = torch.mean(non_aborted_response_length).detach().item()
        non_aborted_response_length_max = torch.max(non_aborted_response_length).detach().item()
        non_aborted_response_length_min = torch.min(non_aborted_response_length).detach().item()
        non_aborted_response_length_clip_ratio = (
            torch.mean(torch.eq(non_aborted_response_length, max_response_length).float()).detach().item()
        )
    else:
        logger.warning("All samples are aborted, returning default response length metrics")
        non_aborted_response_length_mean = float("nan")
        non_aborted_response_length_max = float("nan")
        non_aborted_response_length_min = float("nan")
        non_aborted_response_length_clip_ratio = float("nan")

    if use_critic:
        values = batch.batch["values"]
        valid_values = torch.masked_select(values, response_mask)
        if valid_returns.numel() > 0 and valid_values.numel() > 0:
            return_diff_var = torch.var(valid_returns - valid_values)
            return_var = torch.var(valid_returns)
            critic_value_metrics = {
                # values
                "critic/values/mean": torch.mean(valid_values).detach().item(),
                "critic/values/max": torch.max(valid_values).detach().item(),
                "critic/values/min": torch.min(valid_values).detach().item(),
                # vf explained var
                "critic/vf_explained_var": (1.0 - return_diff_var / (return_var + 1e-5)).detach().item(),
            }
        else:
            logger.warning("Response mask is all False, returning default value metrics")
            critic_value_metrics = {
                "critic/values/mean": float("nan"),
                "critic/values/max": float("nan"),
                "critic/values/min": float("nan"),
                # vf explained var
                "critic/vf_explained_var": float("nan"),
            }
    else:
        critic_value_metrics = {}

    metrics = {
        # score
        "critic/score/mean": score_mean,
        "critic/score/max": score_max,
        "critic/score/min": score_min,
        # reward
        "critic/rewards/mean": reward_mean,
        "critic/rewards/max": reward_max,
        "critic/rewards/min": reward_min,
        # adv
        "critic/advantages/mean": adv_mean,
        "critic/advantages/max": adv_max,
        "critic/advantages/min": adv_min,
        # returns
        "critic/returns/mean": returns_mean,
        "critic/returns/max": returns_max,
        "critic/returns/min": returns_min,
        **critic_value_metrics,
        # response length
        "response_length/mean": torch.mean(response_length).detach().item(),
        "response_length/max": torch.max(response_length).detach().item(),
        "response_length/min": torch.min(response_length).detach().item(),
        "response_length/clip_ratio": torch.mean(torch.eq(response_length, max_response_length).float())
        .detach()
        .item(),
        # response length (non-aborted only)
        # These statistics exclude aborted samples to avoid skew from zeros
        "response_length_non_aborted/mean": non_aborted_response_length_mean,
        "response_length_non_aborted/max": non_aborted_response_length_max,
        "response_length_non_aborted/min": non_aborted_response_length_min,
        "response_length_non_aborted/clip_ratio": non_aborted_response_length_clip_ratio,
        # aborted ratio
        # Fraction of samples whose response length is zero
        "response/aborted_ratio": aborted_ratio,
        # prompt length
        "prompt_length/mean": torch.mean(prompt_length).detach().item(),
        "prompt_length/max": torch.max(prompt_length).detach().item(),
        "prompt_length/min": torch.min(prompt_length).detach().item(),
        "prompt_length/clip_ratio": torch.mean(torch.eq(prompt_length, max_prompt_length).float()).detach().item(),
    }

    # multi-turn conversation
    if "__num_turns__" in batch.non_tensor_batch:
        num_turns = batch.non_tensor_batch["__num_turns__"]
        metrics["num_turns/min"] = num_turns.min()
        metrics["num_turns/max"] = num_turns.max()
        metrics["num_turns/mean"] = num_turns.mean()

    if "tool_call_counts" in batch.non_tensor_batch:
        tool_call_counts = batch.non_tensor_batch["tool_call_counts"]
        metrics["tool_call_counts/min"] = tool_call_counts.min()
        metrics["tool_call_counts/max"] = tool_call_counts.max()
        metrics["tool_call_counts/mean"] = tool_call_counts.mean()

    return metrics


def compute_timing_metrics(batch: DataProto, timing_raw: dict[str, float]) -> dict[str, Any]:
    """
    Computes timing metrics for different processing stages in PPO training.

    This function calculates both raw timing metrics (in seconds) and per-token timing metrics
    (in milliseconds) for various processing stages like generation, reference computation,
    value computation, advantage computation, and model updates.

    Args:
        batch: A DataProto object containing batch data with responses and attention masks.
        timing_raw: A dictionary mapping stage names to their execution times in seconds.

    Returns:
        A dictionary containing:
            - timing_s/{name}: Raw timing in seconds for each stage
            - timing_per_token_ms/{name}: Per-token timing in milliseconds for each stage

    Note:
        Different stages use different token counts for normalization:
        - "gen" uses only response tokens
        - Other stages ("ref", "values", "adv", "update_critic", "update_actor") use all tokens
          (prompt + response)
    """
    response_info = _compute_response_info(batch)
    num_prompt_tokens = torch.sum(response_info["prompt_length"]).item()
    num_response_tokens = torch.sum(response_info["response_length"]).item()
    num_overall_tokens = num_prompt_tokens + num_response_tokens

    num_tokens_of_section = {
        "gen": num_response_tokens,
        **{name: num_overall_tokens for name in ["ref", "values", "adv", "update_critic", "update_actor"]},
    }

    return {
        **{f"timing_s/{name}": value for name, value in timing_raw.items()},
        **{
            f"timing_per_token_ms/{name}": (
                timing_raw[name] * 1000 / num_tokens_of_section[name] if num_tokens_of_section[name] > 0 else 0.0
            )
            for name in set(num_tokens_of_section.keys()) & set(timing_raw.keys())
        },
    }


def compute_throughout_metrics(batch: DataProto, timing_raw: dict[str, float], n_gpus: int) -> dict[str, Any]:
    """
    Computes throughput metrics for PPO training.

    This function calculates performance metrics related to token processing speed,
    including the total number of tokens processed, time per step, and throughput
    (tokens per second per GPU).

    Args:
        batch: A DataProto object containing batch data with meta information about token counts.
        timing_raw: A dictionary mapping stage names to their execution times in seconds.
                   Must contain a "step" key with the total step time.
        n_gpus: Number of GPUs used for training.

    Returns:
        A dictionary containing:
            - perf/total_num_tokens: Total number of tokens processed in the batch
            - perf/time_per_step: Time taken for the step in seconds
            - perf/throughput: Tokens processed per second per GPU

    Note:
        The throughput is calculated as total_tokens / (time * n_gpus) to normalize
        across different GPU counts.
    """
    total_num_tokens = sum(batch.meta_info["global_token_num"])
    time = timing_raw["step"]
    # estimated_flops, promised_flops = flops_function.estimate_flops(num_tokens, time)
    # f'Actual TFLOPs/s/GPU​': estimated_flops/(n_gpus),
    # f'Theoretical TFLOPs/s/GPU​': promised_flops,
    return {
        "perf/total_num_tokens": total_num_tokens,
        "perf/time_per_step": time,
        "perf/throughput": total_num_tokens / (time * n_gpus),
    }


def compute_variance_proxy_metrics(batch: DataProto, gradient_norm: float = None) -> dict[str, float]:
    """
    Compute variance proxy metrics using the simplified expected squared norm approach.

    This metric provides a computationally efficient way to monitor gradient variance
    during training. It works for any advantage estimator as long as sum_pi_squared
    is available from the actor.

    Theory:
    - Full variance: Var(g̃) = E[||g̃||²] - ||g_true||²
    - Simplified proxy (when ||g_true||² ≈ 0): Var(g̃) ≈ E[||g̃||²]
    - Using W-score approximation: E[||g̃||²] ≈ E[A² × W(τ)]

    Where W(τ) = Σ_t[1 - 2π_t(y_t) + Σπ²] is the score-norm proxy.
    """
    metrics = {}

    # Check if we have the necessary data (sum_pi_squared is required for W-score)
    if "sum_pi_squared" not in batch.batch or "old_log_probs" not in batch.batch or "advantages" not in batch.batch:
        return metrics

    # Compute W(τ) = Σ_t[1 - 2π_t(y_t) + Σπ²]
    pi_t = torch.exp(batch.batch["old_log_probs"])
    w_per_timestep = 1 - 2 * pi_t + batch.batch["sum_pi_squared"]

    # Get response mask to only consider valid tokens
    response_mask = batch.batch["response_mask"]

    # Use pre-computed rollout IS weights from batch (for variance proxy consistency with training loss)
    # IS weights are computed centrally in ray_trainer.py to avoid duplication
    rollout_is_weights = None
    if "rollout_is_weights" in batch.batch:
        # Extract pre-computed IS weights from batch (already computed in trainer)
        rollout_is_weights = batch.batch["rollout_is_weights"]

        # Scale W by (rollout IS weight)² for optimal baseline under biased estimation
        w_per_timestep = w_per_timestep * (rollout_is_weights**2).detach()

        # Note: IS weight statistics and mismatch metrics are logged in ray_trainer.py

    # Get scalar advantages (mean over timesteps)
    advantages = batch.batch["advantages"]
    # Compute mean advantage per trajectory using masked_mean
    advantages_scalar = verl_F.masked_mean(advantages, response_mask, axis=-1)

    # Compute W values (sum over timesteps)
    w_values = verl_F.masked_sum(w_per_timestep, response_mask, axis=-1)

    # ====== COMPUTE VARIANCE PROXIES ======
    # Variance proxy should match the actual gradient computation:
    # - If IS weights were computed/applied: use them in variance proxy calculation
    # - Otherwise: compute on-policy variance proxy

    # ====== PROXY 1: Signal Strength ||ḡ||² ======
    # The squared norm of the mean gradient (provided from training loop)
    proxy1_signal_strength = gradient_norm**2 if gradient_norm is not None else None

    # ====== PROXY 2: Total Power E[||ĝ_τ||²] ======
    # Measures the average of squared gradient norms (Signal + Noise)
    if rollout_is_weights is not None:
        # Off-policy with IS correction applied: use clamped weights consistently with actual gradient computation
        rollout_is_weights_scalar = verl_F.masked_mean(rollout_is_weights, response_mask, axis=-1)
        # Recover original W (before IS correction was applied in line 657)
        # Clamp to avoid division by zero when IS weights are zero
        w_original = verl_F.masked_sum(
            w_per_timestep / torch.clamp((rollout_is_weights**2).detach(), min=1e-10), response_mask, axis=-1
        )
        # Clamp W to avoid negative values (which would cause NaN in sqrt)
        w_original = torch.clamp(w_original, min=0.0)
        # Proxy 2 for off-policy: E[ρ̄² × A² × W]
        proxy2_total_power = ((rollout_is_weights_scalar**2) * (advantages_scalar**2) * w_original).mean()

    else:
        # On-policy Proxy 2: E[A² × W]
        # Clamp W to avoid negative values (which would cause NaN in sqrt)
        w_values_clamped = torch.clamp(w_values, min=0.0)
        proxy2_total_power = (advantages_scalar**2 * w_values_clamped).mean()

    # ====== PROXY 3: Pure Noise - Variance of Mean Vector ======
    # Requires ||ḡ||² from actual batch gradient
    # Formula: (1/(N-1)) × (Proxy2 - Proxy1)
    proxy3_pure_noise = None
    if proxy1_signal_strength is not None:
        batch_size = advantages_scalar.shape[0]
        if batch_size > 1:
            proxy3_pure_noise = (1.0 / (batch_size - 1)) * (proxy2_total_power - proxy1_signal_strength)
            # Ensure non-negative (can be negative due to numerical errors)
            proxy3_pure_noise = max(
                0.0, proxy3_pure_noise.item() if torch.is_tensor(proxy3_pure_noise) else proxy3_pure_noise
            )

    # Decompose into components for analysis
    expected_a_squared = (advantages_scalar**2).mean()
    expected_w = w_values.mean()

    metrics.update(
        {
            # Proxy 1: Signal Strength ||ḡ||²
            "variance_proxy/proxy1_signal_strength": (
                proxy1_signal_strength if proxy1_signal_strength is not None else 0.0
            ),
            # Proxy 2: Total Power E[||ĝ_τ||²]
            "variance_proxy/proxy2_total_power": proxy2_total_power.detach().item(),
            # Proxy 3: Pure Noise - Variance of Mean Vector
            "variance_proxy/proxy3_pure_noise": proxy3_pure_noise if proxy3_pure_noise is not None else 0.0,
            # Component metrics for debugging
            "variance_proxy/expected_a_squared": expected_a_squared.detach().item(),
            "variance_proxy/expected_w": expected_w.detach().item(),
        }
    )

    return metrics


def bootstrap_metric(
    data: list[Any],
    subset_size: int,
    reduce_fns: list[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """
    Performs bootstrap resampling to estimate statistics of metrics.

    This function uses bootstrap resampling to estimate the mean and standard deviation
    of metrics computed by the provided reduction functions on random subsets of the data.

    Args:
        data: List of data points to bootstrap from.
        subset_size: Size of each bootstrap sample.
        reduce_fns: List of functions that compute a metric from a subset of data.
        n_bootstrap: Number of bootstrap iterations. Defaults to 1000.
        seed: Random seed for reproducibility. Defaults to 42.

    Returns:
        A list of tuples, where each tuple contains (mean, std) for a metric
        corresponding to each reduction function in reduce_fns.

    Example:
        >>> data = [1, 2, 3, 4, 5]
        >>> reduce_fns = [np.mean, np.max]
        >>> bootstrap_metric(data, 3, reduce_fns)
        [(3.0, 0.5), (4.5, 0.3)]  # Example values
    """
    np.random.seed(seed)
    data_np = np.array(data, dtype=object)
    n_data = len(data_np)

    # generate bootstrap indices, shape: (n_bootstrap, subset_size)
    bootstrap_idxs = np.random.choice(n_data, size=(n_bootstrap, subset_size), replace=True)

    # pre-allocate result array, shape: (n_fns, n_bootstrap)
    n_fns = len(reduce_fns)
    metric_results = np.empty((n_fns, n_bootstrap), dtype=np.float64)

    # compute metric results for each bootstrap sample
    for fn_idx, reduce_fn in enumerate(reduce_fns):
        # bootstrap sample and compute metric
        for boot_idx in range(n_bootstrap):
            sample = data_np[bootstrap_idxs[boot_idx]]
            metric_results[fn_idx, boot_idx] = reduce_fn(sample)

    # compute mean and std for each metric function
    result = [
        (float(np.mean(metric_results[fn_idx])), float(np.std(metric_results[fn_idx]))) for fn_idx in range(n_fns)
    ]
    return result


def calc_maj_val(data: list[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """
    Calculate a value based on majority voting.

    This function identifies the most common value for a specified vote key
    in the data, then returns the corresponding value for that majority vote.

    Args:
        data: List of dictionaries, where each dictionary contains both vote_key and val_key.
        vote_key: The key in each dictionary used for voting/counting.
        val_key: The key in each dictionary whose value will be returned for the majority vote.

    Returns:
        The value associated with the most common vote.

    Example:
        >>> data = [
        ...     {"pred": "A", "val": 0.9},
        ...     {"pred": "B", "val": 0.8},
        ...     {"pred": "A", "val": 0.7}
        ... ]
        >>> calc_maj_val(data, vote_key="pred", val_key="val")
        0.9  # Returns the first "val" for the majority vote "A"
    """
    vote2vals = defaultdict(list)
    for d in data:
        vote2vals[d[vote_key]].append(d[val_key])

    vote2cnt = {k: len(v) for k, v in vote2vals.items()}
    maj_vote = max(vote2cnt, key=vote2cnt.get)

    maj_val = vote2vals[maj_vote][0]

    return maj_val


def process_validation_metrics(
    data_sources: list[str], sample_uids: list[str], infos_dict: dict[str, list[Any]], seed: int = 42
) -> dict[str, dict[str, dict[str, float]]]:
    """
    Process validation metrics into a structured format with statistical analysis.

    This function organizes validation metrics by data source and prompt, then computes
    various statistical measures including means, standard deviations, best/worst values,
    and majority voting results. It also performs bootstrap sampling to estimate statistics
    for different sample sizes.

    Args:
        data_sources: List of data source identifiers for each sample.
        sample_uids: List of sample uids corresponding to each sample.
        infos_dict: Dictionary mapping variable names to lists of values for each sample.
        seed: Random seed for bootstrap sampling. Defaults to 42.

    Returns:
        A nested dictionary with the structure:
        {
            data_source: {
                variable_name: {
                    metric_name: value
                }
            }
        }

        Where metric_name includes:
        - "mean@N": Mean value across N samples
        - "std@N": Standard deviation across N samples
        - "best@N/mean": Mean of the best values in bootstrap samples of size N
        - "best@N/std": Standard deviation of the best values in bootstrap samples
        - "worst@N/mean": Mean of the worst values in bootstrap samples
        - "worst@N/std": Standard deviation of the worst values in bootstrap samples
        - "maj@N/mean": Mean of majority voting results in bootstrap samples (if "pred" exists)
        - "maj@N/std": Standard deviation of majority voting results (if "pred" exists)

    Example:
        >>> data_sources = ["source1", "source1", "source2"]
        >>> sample_uids = ["uid1", "uid1", "uid2"]
        >>> infos_dict = {"score": [0.8, 0.9, 0.7], "pred": ["A", "A", "B"]}
        >>> result = process_validation_metrics(data_sources, sample_uids, infos_dict)
        >>> # result will contain statistics for each data source and variable
    """
    # Group metrics by data source, prompt and variable
    data_src2uid2var2vals = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for sample_idx, data_source in enumerate(data_sources):
        uid = sample_uids[sample_idx]
        var2vals = data_src2uid2var2vals[data_source][uid]
        for var_name, var_vals in infos_dict.items():
            var2vals[var_name].append(var_vals[sample_idx])

    np_mean = np.mean
    np_std = np.std
    reduce_fns_best_worst = [np.max, np.min]
    n_bootstrap = 1000

    # 2. cache ns list
    def gen_ns(n_resps: int) -> list[int]:
        if n_resps <= 1:
            return []
        ns = []
        n = 2
        while n < n_resps:
            ns.append(n)
            n *= 2
        ns.append(n_resps)
        return ns

    ns_cache = {}

    # 3. cache metric results
    data_src2uid2var2metric = {}

    # 4. flatten loop
    for data_source, uid2var2vals in data_src2uid2var2vals.items():
        # create uid dict
        uid_dict = data_src2uid2var2metric.setdefault(data_source, {})

        for uid, var2vals in uid2var2vals.items():
            pred_vals = var2vals.get("pred")
            has_pred = pred_vals is not None
            var_dict = uid_dict.setdefault(uid, {})

            for var_name, var_vals in var2vals.items():
                # skip empty or string values
                if not var_vals or isinstance(var_vals[0], str):
                    continue

                # compute mean and std
                n_resps = len(var_vals)
                metric = {f"mean@{n_resps}": float(np_mean(var_vals))}

                if n_resps > 1:
                    metric[f"std@{n_resps}"] = float(np_std(var_vals))

                    # cache ns list
                    if n_resps not in ns_cache:
                        ns_cache[n_resps] = gen_ns(n_resps)
                    ns = ns_cache[n_resps]

                    # compute best/worst metrics
                    for n in ns:
                        # compute best/worst metrics
                        (bon_mean, bon_std), (won_mean, won_std) = bootstrap_metric(
                            data=var_vals,
                            subset_size=n,
                            reduce_fns=reduce_fns_best_worst,
                            n_bootstrap=n_bootstrap,
                            seed=seed,
                        )
                        metric[f"best@{n}/mean"] = bon_mean
                        metric[f"best@{n}/std"] = bon_std
                        metric[f"worst@{n}/mean"] = won_mean
                        metric[f"worst@{n}/std"] = won_std

                        # compute maj metrics
                        if has_pred:
                            # create vote_data
                            vote_data = [
                                {"val": val, "pred": pred} for val, pred in zip(var_vals, pred_vals, strict=True)
                            ]
                            # compute maj metrics
                            [(maj_n_mean, maj_n_std)] = bootstrap_metric(
                                data=vote_data,
                                subset_size=n,
                                reduce_fns=[partial(calc_maj_val, vote_key="pred", val_key="val")],
                                n_bootstrap=n_bootstrap,
                                seed=seed,
                            )
                            metric[f"maj@{n}/mean"] = maj_n_mean
                            metric[f"maj@{n}/std"] = maj_n_std

                var_dict[var_name] = metric

    # Aggregate metrics across uids
    data_src2var2metric2uid_vals = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for data_source, uid2var2metric in data_src2uid2var2metric.items():
        for uid, var2metric in uid2var2metric.items():
            for var_name, metric in var2metric.items():
                for metric_name, metric_val in metric.items():
                    data_src2var2metric2uid_vals[data_source][var_name][metric_name].append(metric_val)

    data_src2var2metric2val = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for data_source, var2metric2uid_vals in data_src2var2metric2uid_vals.items():
        for var_name, metric2uid_vals in var2metric2uid_vals.items():
            for metric_name, uid_vals in metric2uid_vals.items():
                data_src2var2metric2val[data_source][var_name][metric_name] = np.mean(uid_vals)
    return data_src2var2metric2val

"""vLLM 0.24.0's own verdict on each case (run by test_engine_limits in a fresh interpreter; JSON in and out).

Real: vLLM's ModelConfig (its config.json reading through transformers, _get_and_verify_max_len),
ParallelConfig, ModelConfig.verify_with_parallel_config and QKVParallelLinear.__init__ (on the meta device), and
verl's own get_max_position_embeddings for the max_model_len verl passes (verl's comparison with it, three lines
of vLLMHttpServer._validate_configs, is restated: that module imports vLLM's GPU server). Not real: the tensor parallel group,
which needs GPUs; QKVParallelLinear reads its size from a stand-in holding the case's size.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any


def main() -> None:
    import torch
    import vllm.distributed.parallel_state as parallel_state
    from transformers import AutoConfig
    from verl.workers.rollout.utils import get_max_position_embeddings
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import QKVParallelLinear

    cases: list[dict[str, Any]] = json.loads(sys.stdin.read())
    work = Path(tempfile.mkdtemp(dir="."))
    dirs: dict[str, Path] = {}

    def model_dir(config: dict[str, Any]) -> str:
        key = json.dumps(config, sort_keys=True)
        if key not in dirs:
            path = work / f"m{len(dirs)}"
            path.mkdir()
            (path / "config.json").write_text(key)
            dirs[key] = path
        return str(dirs[key])

    built: dict[str, Any] = {}

    def shared_config(config: dict[str, Any]) -> Any:
        """One ModelConfig per model for the parallel-size cases (they do not change it)."""
        key = json.dumps(config, sort_keys=True)
        if key not in built:
            built[key] = model_config(config)
        return built[key]

    def model_config(config: dict[str, Any], max_model_len: int | None = None) -> Any:
        path = model_dir(config)
        return ModelConfig(
            model=path,
            tokenizer=path,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=max_model_len,
        )

    def refused(call: Any, *args: Any) -> str | None:
        try:
            call(*args)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {exc}".split("\n")[0]
        return None

    def split(config: dict[str, Any], tp: int) -> str | None:
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head = config.get("head_dim") or config["hidden_size"] // heads
        parallel_state._TP = types.SimpleNamespace(world_size=tp, rank_in_group=0)
        with (
            set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))),
            torch.device("meta"),
        ):
            QKVParallelLinear(config["hidden_size"], head, heads, kv_heads, bias=False)
        return None

    def verdict(case: dict[str, Any]) -> str | None:
        config, kind = case["config"], case["kind"]
        if kind == "tp":
            verify = shared_config(config).verify_with_parallel_config
            return refused(verify, ParallelConfig(tensor_parallel_size=case["tp"])) or refused(
                split, config, case["tp"]
            )
        if kind == "ep":
            parallel = ParallelConfig(tensor_parallel_size=case["tp"], enable_expert_parallel=True)
            return refused(shared_config(config).verify_with_parallel_config, parallel)
        # the max_model_len verl passes: its own value or the model's positions, compared by verl first
        positions = get_max_position_embeddings(AutoConfig.from_pretrained(model_dir(config)))
        own, extra = case["rollout_max_model_len"], case["engine_max_model_len"]
        if own is not None and own > positions:
            return f"ValueError: max_model_len ({own}) should be less than or equal to max_position_embeddings ({positions})"
        return refused(model_config, config, extra or own or positions)

    out = [{"refused": verdict(case)} for case in cases]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

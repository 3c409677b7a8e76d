"""megatron-core 0.18.0's own verdict on each case (run by test_engine_limits in a fresh interpreter; JSON in/out).

Real, in the order verl's Megatron engine reaches them: parallel_state.initialize_model_parallel (on torch's
fake process group of the case's GPU count, which checks the sizes and builds the groups without devices),
TransformerConfig.__post_init__, get_num_layers_to_build, and MoELayer's __init__ (BaseMoELayer's, with an
expert-parallel group of the case's size). Not real: ``megatron.core.transformer.moe.paged_stash``, which
imports triton (a 1 GB GPU compiler) and holds no check, is a stand-in module; the MoE layer's process groups
are stand-ins that only report their size. The model's TransformerConfig fields are those Megatron-Bridge's
providers set for these families (no linear biases; Qwen2's query/key/value biases).
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def main() -> None:
    sys.modules["megatron.core.transformer.moe.paged_stash"] = _StandIn(
        "megatron.core.transformer.moe.paged_stash"
    )
    import warnings

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")

    class MoE(BaseMoELayer):
        def forward(self, hidden_states: Any) -> Any:
            return hidden_states

    def verdict(case: dict[str, Any]) -> str | None:
        m, s = case["model"], case["sizes"]
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=s["gpus"])
        try:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=s["tp"],
                pipeline_model_parallel_size=s["pp"],
                virtual_pipeline_model_parallel_size=s["vpp"],
                context_parallel_size=s["cp"],
                expert_model_parallel_size=s["ep"],
                expert_tensor_parallel_size=s["etp"],
                create_gloo_process_groups=False,
            )
            config = TransformerConfig(
                num_layers=m["layers"],
                hidden_size=m["hidden"],
                num_attention_heads=m["heads"],
                num_query_groups=m["kv_heads"],
                kv_channels=m["head_dim"],
                ffn_hidden_size=m["ffn"],
                add_bias_linear=False,  # as Megatron-Bridge's providers set it for these families
                add_qkv_bias=m["qkv_bias"],
                num_moe_experts=m["experts"] or None,
                moe_router_topk=2,
                moe_ffn_hidden_size=m["ffn"] if m["experts"] else None,
                tensor_model_parallel_size=s["tp"],
                pipeline_model_parallel_size=s["pp"],
                virtual_pipeline_model_parallel_size=s["vpp"],
                context_parallel_size=s["cp"],
                expert_model_parallel_size=s["ep"],
                expert_tensor_parallel_size=s["etp"],
                sequence_parallel=s["tp"] > 1,
                pipeline_dtype=torch.bfloat16,
                bf16=True,
                params_dtype=torch.bfloat16,
                num_layers_in_first_pipeline_stage=s["first"],
                num_layers_in_last_pipeline_stage=s["last"],
                account_for_embedding_in_pipeline_split=s["embedding"],
                account_for_loss_in_pipeline_split=s["loss"],
            )
            for rank in range(s["pp"]):
                get_num_layers_to_build(config, vp_stage=0, pp_rank=rank)
            if m["experts"]:
                MoE(
                    config,
                    layer_number=1,
                    pg_collection=types.SimpleNamespace(ep=_Group(s["ep"]), tp=_Group(1)),
                )
        except (ValueError, AssertionError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        return None

    cases: list[dict[str, Any]] = json.loads(sys.stdin.read())
    print(json.dumps([{"refused": verdict(case)} for case in cases]))


if __name__ == "__main__":
    main()

"""Architecture features read from config.json: MoE under every spelling, softcapping, sliding window, ties."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import EXAMPLES, CliResult

from verl_safe_launch.inputs import load_architecture
from verl_safe_launch.inputs.architecture import bundled_table, from_config_dict

MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"
EIGHT_GPUS = (
    f"actor_rollout_ref.model.path={MIXTRAL}",
    "trainer.n_gpus_per_node=8",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.rollout.n=8",
    "hardware.gpu_memory_gb=80",
)


@pytest.fixture(autouse=True)
def declared_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


@pytest.mark.parametrize("name", sorted(k for k, v in bundled_table().items() if "computed_param_count" in v))
def test_parameter_count_matches_the_table(name: str) -> None:
    arch = load_architecture(name)
    assert arch is not None
    assert arch.params == bundled_table()[name]["computed_param_count"]


DENSE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 1000,
}


@pytest.mark.parametrize(
    ("extra", "experts", "per_token", "shared", "dense_layers"),
    [
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, 8, 2, 0, 0),  # Mixtral
        (
            {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32},
            16,
            4,
            0,
            0,
        ),  # Qwen3-MoE
        (  # Qwen2-MoE: one gated shared expert
            {"num_experts": 8, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 128},
            8,
            2,
            128,
            0,
        ),
        (  # DeepSeek: shared experts counted in moe_intermediate_size units, first layers dense
            {
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "n_shared_experts": 2,
            }
            | {"first_k_dense_replace": 1},
            8,
            2,
            64,
            1,
        ),
    ],
)
def test_moe_under_every_spelling(
    extra: dict[str, Any], experts: int, per_token: int, shared: int, dense_layers: int
) -> None:
    arch = from_config_dict({**DENSE, **extra}, "m", "test")
    assert (arch.num_experts, arch.num_experts_per_tok) == (experts, per_token)
    assert arch.shared_expert_intermediate_size == shared
    assert arch.moe_layers == 4 - dense_layers
    dense = from_config_dict(DENSE, "d", "test")
    assert arch.params > dense.params  # experts are counted in full


def test_sliding_window_only_when_used() -> None:
    assert from_config_dict({**DENSE, "sliding_window": 4096}, "m", "t").sliding_window == 4096
    off = {
        **DENSE,
        "sliding_window": 4096,
        "use_sliding_window": False,
    }  # Qwen2 configs carry a window, unused
    assert from_config_dict(off, "m", "t").sliding_window == 0


def test_mixtral_from_the_table() -> None:
    arch = load_architecture(MIXTRAL)
    assert arch is not None and arch.num_experts == 8 and arch.expert_intermediate_size == 14336
    assert round(arch.params / 1e9, 1) == 46.7  # the published total


def test_mixtral_over_eight_gpus_is_no_go_without_offload(cli: Callable[..., CliResult]) -> None:
    example = str(EXAMPLES / "grpo_6gpu.yaml")
    r = cli("estimate", "--format", "json", "-c", example, *EIGHT_GPUS)
    assert r.code == 0, r.err
    import json

    stages = {s["name"]: s for s in json.loads(r.out)["stages"]}
    update = stages["actor update"]
    assert update["components_gib"]["parameters"] == pytest.approx(21.7, abs=0.1)
    assert update["verdict"] == "out of memory"
    check = cli("check", "-c", example, *EIGHT_GPUS)
    assert check.code != 0
    assert "NO-GO" in check.out and "actor update needs" in check.out


def test_parameter_count_agrees_with_transformers() -> None:
    """The shapes formula against the real model classes built on the meta device (no weights)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in (MIXTRAL, "google/gemma-2-2b"):
        table = bundled_table()[name]
        keys = set(DENSE) | {"head_dim", "tie_word_embeddings", "num_local_experts", "num_experts_per_tok"}
        kwargs = {k: v for k, v in table.items() if k in keys}
        config = transformers.AutoConfig.for_model(table["model_type"], **kwargs)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        counted = sum(p.numel() for p in model.parameters())
        arch = load_architecture(name)
        assert arch is not None and arch.params == counted, name


LATENT_AND_VISION = ("deepseek-ai/DeepSeek-V2-Lite", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen1.5-MoE-A2.7B")


def _model_dir(tmp_path: Any, name: str) -> Any:
    """A model directory whose config.json is what transformers' config class writes for ``name``."""
    import json

    memory_trace = pytest.importorskip("memory_trace")
    folder = tmp_path / name.split("/")[-1]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(memory_trace.config_dict(name)))
    return folder


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", LATENT_AND_VISION)
def test_latent_attention_and_vision_parameters_agree_with_transformers(name: str, tmp_path: Any) -> None:
    """MLA projections, the vision tower and Qwen2-MoE's q/k/v biases, counted on the real classes (2 layers)."""
    import dataclasses

    torch = pytest.importorskip("torch")
    memory_trace = pytest.importorskip("memory_trace")
    arch = load_architecture(str(_model_dir(tmp_path, name)))
    assert arch is not None
    memory_trace.register_attention()
    config = memory_trace.hf_config(dataclasses.replace(arch, name=name), layers=2)
    with torch.device("meta"):
        model = memory_trace._build(config, ckpt=False)
    counted = sum(p.numel() for p in model.parameters())
    assert dataclasses.replace(arch, num_hidden_layers=2).params == counted


def test_latent_attention_caches_the_compressed_latent(tmp_path: Any) -> None:
    """vLLM's MLA backends cache kv_lora_rank + qk_rope_head_dim values per token per layer, on every TP rank."""
    from verl_safe_launch.memory import kv_bytes_per_token

    arch = load_architecture(str(_model_dir(tmp_path, "deepseek-ai/DeepSeek-V2-Lite")))
    assert arch is not None and arch.mla
    assert kv_bytes_per_token(arch, tp=1) == 27 * (512 + 64) * 2 == 31_104
    assert kv_bytes_per_token(arch, tp=2) == 31_104


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        (
            "deepseek-ai/DeepSeek-V2-Lite",
            "the rollout caches the latent, 576 values per token per layer (31,104 B",
        ),
        (
            "Qwen/Qwen2.5-VL-7B-Instruct",
            "vision tower: 0.68B parameters (32 blocks, width 1280) counted with",
        ),
    ],
)
def test_estimate_shows_latent_attention_and_the_vision_tower(
    cli: Callable[..., CliResult], tmp_path: Any, name: str, shown: str
) -> None:
    folder = _model_dir(tmp_path, name)
    example = str(EXAMPLES / "grpo_6gpu.yaml")
    r = cli("estimate", "-c", example, f"actor_rollout_ref.model.path={folder}", "hardware.gpu_memory_gb=80")
    assert r.code == 0, r.err
    assert shown in r.out


def test_vision_tower_activations_follow_the_image_tokens(tmp_path: Any) -> None:
    """Checkpointed update: each of the 32 blocks keeps its bf16 input per patch (4 patches per image token),
    plus the merged embeddings, which the forward also keeps beside the language model's layers."""
    from dataclasses import replace

    from verl_safe_launch.memory import Pass, pass_peak

    arch = load_architecture(str(_model_dir(tmp_path, "Qwen/Qwen2.5-VL-7B-Instruct")))
    assert arch is not None and arch.vision is not None
    update = Pass(tokens=8192, backward=True, vocab=arch.vocab_size)
    text, images = pass_peak(arch, update), pass_peak(arch, replace(update, image_tokens=4096))
    assert text.phase == images.phase
    assert images.activations - text.activations == 4096 * 4 * 32 * 2 * 1280 + 4096 * 2 * 3584
    forward = Pass(tokens=8192, backward=False, vocab=1)
    text, images = pass_peak(arch, forward), pass_peak(arch, replace(forward, image_tokens=8192))
    assert images.activations - text.activations == 8192 * 2 * 3584  # the merged embeddings, beside the layer

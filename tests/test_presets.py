"""Presets: their exact values on their intended hardware, the choice of ``auto``, and adaptation with reasons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, CliResult

from verl_safe_launch.compose import Composed
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import ComposeRequest, ToolSettings, cli_tokens, detect_hardware
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.presets import choose_auto, compose_for_launch, preset_values
from verl_safe_launch.provenance import Layer
from verl_safe_launch.render import render_finding

ARR = "actor_rollout_ref"
TP = f"{ARR}.rollout.tensor_model_parallel_size"
MICRO = f"{ARR}.actor.ppo_micro_batch_size_per_gpu"
LOGPROB = f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu"
REF = f"{ARR}.ref.log_prob_micro_batch_size_per_gpu"

# Every preset is a complete GRPO recipe: the critic-free estimator, vLLM, KL loss against the reference model.
RECIPE = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "data.filter_overlong_prompts": True,
    f"{ARR}.model.use_remove_padding": True,
    f"{ARR}.model.enable_gradient_checkpointing": True,
    f"{ARR}.actor.use_kl_loss": True,
    f"{ARR}.actor.kl_loss_coef": 0.001,
    f"{ARR}.actor.kl_loss_type": "low_var_kl",
    f"{ARR}.actor.entropy_coeff": 0,
    f"{ARR}.rollout.name": "vllm",
    f"{ARR}.rollout.gpu_memory_utilization": 0.5,
}
OFFLOAD = {f"{ARR}.actor.fsdp_config.param_offload": True, f"{ARR}.actor.fsdp_config.optimizer_offload": True}
SP = f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size"
# The values each preset must carry, exactly.
EXPECTED = {
    "small": {
        **RECIPE,
        **OFFLOAD,
        "data.max_prompt_length": 512,
        "data.max_response_length": 1024,
        "data.train_batch_size": 16,
        "trainer.n_gpus_per_node": 2,
        "trainer.nnodes": 1,
        f"{ARR}.actor.ppo_mini_batch_size": 16,
        MICRO: 4,
        f"{ARR}.rollout.n": 8,
        TP: 1,
        LOGPROB: 4,
        REF: 4,
    },
    "medium": {
        **RECIPE,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 2048,
        "data.train_batch_size": 48,
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 1,
        f"{ARR}.actor.ppo_mini_batch_size": 48,
        MICRO: 6,
        f"{ARR}.rollout.n": 12,
        TP: 2,
        LOGPROB: 6,
        REF: 6,
    },
    "cluster": {
        **RECIPE,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 2048,
        "data.train_batch_size": 128,
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 4,
        f"{ARR}.actor.ppo_mini_batch_size": 128,
        MICRO: 8,
        SP: 4,
        f"{ARR}.ref.fsdp_config.ulysses_sequence_parallel_size": 4,
        f"{ARR}.rollout.n": 8,
        TP: 2,
        LOGPROB: 4,
        REF: 4,
    },
}
INTENDED = {
    "small": ("hardware.gpus_per_node=2",),
    "medium": ("hardware.gpus_per_node=8",),
    "cluster": ("hardware.gpus_per_node=8", "hardware.nodes=4"),
}


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only declared hardware counts in these tests, whatever machine runs them."""
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def _compose(*tokens: str, files: tuple[Path, ...] = (), fit: bool = False) -> Composed:
    return compose_for_launch(ComposeRequest(overrides=cli_tokens(list(tokens)), config_files=files), fit=fit)


def _adapted(view: ConfigView, keys: tuple[str, ...] | None = None) -> dict[str, tuple[Any, str]]:
    """Adapted keys (all, or those of ``keys``) → (value, reason)."""
    return {
        key: (prov.value, prov.source.reason or "")
        for key, prov in view.provenance.items()
        if prov.source.layer is Layer.ADAPTED and (keys is None or key in keys)
    }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_files_carry_exactly_the_documented_values(name: str) -> None:
    assert {key: value for key, value, _ in preset_values(name)} == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_reproduce_their_values_on_their_intended_hardware(name: str) -> None:
    view = _compose(f"preset={name}", *INTENDED[name]).view
    assert {key: view.get(key) for key in EXPECTED[name]} == EXPECTED[name]
    assert _adapted(view) == {}
    prov = view.prov(MICRO)
    assert prov is not None and prov.source.describe().startswith(f"preset {name}, conf/preset/{name}.yaml:")


def test_small_on_one_gpu() -> None:
    view = _compose("preset=small", "hardware.gpus_per_node=1").view
    assert _adapted(view) == {
        "trainer.n_gpus_per_node": (
            1,
            "preset small: the hardware has 1 GPU per node: declared on the command line, argument 2 "
            "(hardware.gpus_per_node=1)",
        )
    }


def test_medium_on_six_gpus_keeps_the_tp_that_fits() -> None:
    view = _compose(
        "preset=medium",
        "hardware.gpus_per_node=6",
        "hardware.gpu_memory_gb=80",
        f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct",
    ).view
    adapted = _adapted(view)
    assert adapted.pop("trainer.n_gpus_per_node")[0] == 6
    assert view.get(TP) == 2
    assert set(adapted) <= {MICRO, LOGPROB, REF}, "only the memory fit may move anything else"
    assert all(value <= EXPECTED["medium"][key] for key, (value, _) in adapted.items())


def test_cluster_raises_tp_until_the_72b_weights_leave_kv_room() -> None:
    view = _compose(
        "preset=cluster",
        "hardware.gpus_per_node=8",
        "hardware.nodes=4",
        "hardware.gpu_memory_gb=80",
        f"{ARR}.model.path=Qwen/Qwen2.5-72B-Instruct",
    ).view
    assert _adapted(view, (TP,)) == {
        TP: (
            4,
            "preset cluster: the smallest TP above the preset's that fits: 33.9 GiB of weights per GPU leave the "
            "KV cache of gpu_memory_utilization 0.5 × 80 GiB 48428 tokens ≥ 32768 (max_model_len 32768); it "
            "divides 8 GPUs per node and the heads (64 attention, 8 KV)",
        )
    }


def test_offload_is_adapted_with_the_stage_it_relieves() -> None:
    view = _compose(
        "preset=medium",
        "hardware.gpus_per_node=4",
        "hardware.gpu_memory_gb=48",
        f"{ARR}.model.path=Qwen/Qwen2.5-14B-Instruct",
    ).view
    reason = _adapted(view)[f"{ARR}.actor.fsdp_config.optimizer_offload"][1]
    assert reason.startswith(
        "preset medium: the optimizer states wait on the CPU outside the update; without it "
    )
    assert "old log-prob needs ~47.6 GiB per GPU" in reason


def test_cluster_on_two_nodes_of_eight() -> None:
    view = _compose("preset=cluster", "hardware.gpus_per_node=8", "hardware.nodes=2").view
    assert _adapted(view) == {
        "trainer.nnodes": (
            2,
            "preset cluster: the hardware has 2 nodes: declared on the command line, argument 3 (hardware.nodes=2)",
        )
    }
    runnable = ("algorithm.adv_estimator=grpo", f"{ARR}.rollout.name=vllm")
    preflight = run_preflight(
        _compose("preset=cluster", "hardware.gpus_per_node=8", "hardware.nodes=2", *runnable)
    )
    assert preflight.ok, [f.message for f in preflight.findings if f.severity.value == "error"]


def test_medium_on_five_gpus_moves_batch_sizes_to_the_nearest_valid() -> None:
    view = _compose("preset=medium", "hardware.gpus_per_node=5").view
    adapted = _adapted(view)
    assert adapted["data.train_batch_size"] == (
        50,
        "preset medium: 48 prompts × rollout.n 12 = 576 trajectories do not split evenly over 5 GPUs; "
        "50 × 12 = 600 do (the nearest such size)",
    )
    assert adapted[f"{ARR}.actor.ppo_mini_batch_size"][0] == 50
    assert adapted[TP] == (
        1,
        "preset medium: the largest TP up to 2 that divides 5 GPUs per node and the heads (32 attention, 32 KV)",
    )


def test_cluster_on_one_six_gpu_node_shrinks_ulysses_and_batches() -> None:
    view = _compose("preset=cluster", "hardware.gpus_per_node=6", "hardware.nodes=1").view
    adapted = {key: value for key, (value, _) in _adapted(view).items()}
    assert adapted == {
        "trainer.n_gpus_per_node": 6,
        "trainer.nnodes": 1,
        SP: 2,
        f"{ARR}.ref.fsdp_config.ulysses_sequence_parallel_size": 2,
        "data.train_batch_size": 129,
        f"{ARR}.actor.ppo_mini_batch_size": 129,
    }
    assert view.get(f"{ARR}.ref.fsdp_config.ulysses_sequence_parallel_size") == 2


def test_user_values_are_never_adapted() -> None:
    view = _compose("preset=medium", "hardware.gpus_per_node=5", "data.train_batch_size=60").view
    assert view.get("data.train_batch_size") == 60
    assert _adapted(view)[f"{ARR}.actor.ppo_mini_batch_size"][0] == 50
    prov = view.prov(f"{ARR}.actor.ppo_mini_batch_size")
    assert prov is not None and [w.source.layer for w in prov.history] == [Layer.VERL, Layer.PRESET]


def test_preset_medium_on_the_bundled_example_passes_the_preflight() -> None:
    composed = _compose("preset=medium", files=(EXAMPLES / "grpo_6gpu.yaml",))
    preflight = run_preflight(composed)
    assert preflight.ok, [f.message for f in preflight.findings if f.severity.value == "error"]


def test_preset_auto_on_the_preset_example_with_declared_hardware() -> None:
    composed = _compose(
        "preset=auto",
        "hardware.gpus_per_node=6",
        "hardware.gpu_memory_gb=80",
        files=(EXAMPLES / "grpo_preset.yaml",),
    )
    adapted = _adapted(composed.view)
    assert adapted["trainer.n_gpus_per_node"][0] == 6
    assert TP not in adapted, "the preset's TP 2 divides 6 GPUs and fits"
    preflight = run_preflight(composed)
    assert preflight.ok, [f.message for f in preflight.findings if f.severity.value == "error"]
    infos = {f.rule_id: f for f in preflight.findings}
    assert infos["preset-auto"].message == (
        "preset=auto chose medium: 6 GPUs on 1 node; declared on the command line, argument 2 "
        "(hardware.gpus_per_node=6)"
    )
    key = "trainer.n_gpus_per_node"
    adapted_findings = [f for f in preflight.findings if f.rule_id == "preset-adapted" and f.keys == (key,)]
    assert render_finding(adapted_findings[0]).splitlines()[0] == (
        f"info [preset-adapted] preset medium adapted {key} from 8 to 6"
    )


@pytest.mark.parametrize(
    ("tokens", "name"),
    [
        (("hardware.gpus_per_node=1",), "small"),
        (("hardware.gpus_per_node=2",), "small"),
        (("hardware.gpus_per_node=6",), "medium"),
        (("hardware.gpus_per_node=8", "hardware.nodes=1"), "medium"),
        (("hardware.gpus_per_node=8", "hardware.nodes=2"), "cluster"),
    ],
)
def test_auto_picks_by_hardware(tokens: tuple[str, ...], name: str) -> None:
    tool = _tool(*tokens)
    assert choose_auto(detect_hardware(tool, env={}), None)[0] == name


def _tool(*tokens: str) -> ToolSettings:
    from verl_safe_launch.inputs import split_tool_tokens

    return split_tool_tokens(cli_tokens(list(tokens)))[1]


def test_auto_falls_back_to_the_users_gpu_counts() -> None:
    view = _compose("preset=auto", files=(EXAMPLES / "grpo_6gpu.yaml",)).view
    assert view.prov("data.train_batch_size") is not None
    assert choose_auto(detect_hardware(ToolSettings(), env={}), view)[0] == "medium"


def test_auto_without_any_gpu_count_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as err:
        _compose("data.train_batch_size=64", "preset=auto")
    assert err.value.render() == (
        "error: preset=auto cannot pick a preset: the number of GPUs is unknown\n"
        "  where: command line, argument 2 (preset=auto)\n"
        "  fix: declare the hardware, e.g. hardware.gpus_per_node=8 hardware.nodes=1, or run inside the Slurm "
        "allocation or on the GPU machine"
    )


def test_micro_batches_are_capped_at_the_preset_values() -> None:
    tokens = ("preset=medium", "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=80")
    view = _compose(*tokens, f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct").view
    assert {key: view.get(key) for key in (MICRO, LOGPROB, REF)} == {MICRO: 6, LOGPROB: 6, REF: 6}
    tiny = _compose(*tokens, f"{ARR}.model.path=Qwen/Qwen2.5-0.5B-Instruct").view
    assert {key: tiny.get(key) for key in (MICRO, LOGPROB, REF)} == {MICRO: 6, LOGPROB: 6, REF: 6}


def test_fit_lets_micro_batches_grow() -> None:
    tokens = ("preset=medium", "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=80")
    view = _compose(*tokens, f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct", fit=True).view
    grown = {key: value for key, (value, _) in _adapted(view, (MICRO, LOGPROB, REF)).items()}
    assert grown and all(value > 6 for value in grown.values())


def test_fit_never_touches_user_micro_batches() -> None:
    tokens = ("preset=medium", "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=80", f"{MICRO}=4")
    view = _compose(*tokens, f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct", fit=True).view
    assert view.get(MICRO) == 4 and MICRO not in _adapted(view)


def test_show_origin_names_the_adaptation(cli) -> None:  # type: ignore[no-untyped-def]
    result: CliResult = cli(
        "show", "preset=small", "hardware.gpus_per_node=1", "--key", "trainer.n_gpus_per_node"
    )
    assert result.code == 0
    assert result.out == (
        "trainer.n_gpus_per_node = 1\n"
        "    from preset adapted to hardware: preset small: the hardware has 1 GPU per node: declared on the "
        "command line, argument 3 (hardware.gpus_per_node=1)\n"
        "    replaced 2 from preset small, conf/preset/small.yaml:16\n"
        "    replaced 8 from verl default, verl/trainer/config/ppo_trainer.yaml:"
        + result.out.rsplit("ppo_trainer.yaml:", 1)[1]
    )


def test_presets_verb_lists_and_shows(cli) -> None:  # type: ignore[no-untyped-def]
    listing: CliResult = cli("presets")
    assert listing.code == 0
    assert listing.out.splitlines()[:5] == [
        "NAME     HARDWARE                  MODELS   SUMMARY",
        "small    1-2 GPUs, one machine     7B-13B   short steps, TP 1, small micro batches",
        "medium   6-8 GPUs, one node        13B-34B  48 prompts x 12 samples, rollout TP 2",
        "cluster  several nodes x 8 GPUs    70B+     FSDP + Ulysses 4 (remove padding on), rollout TP 2",
        "auto     picked from the hardware  -        up to 2 GPUs: small; one node: medium; more: cluster",
    ]
    shown: CliResult = cli("presets", "medium")
    assert (
        shown.out.splitlines()[0]
        == "preset medium: 6-8 GPUs, one node; models 13B-34B (conf/preset/medium.yaml)"
    )
    assert "  data.train_batch_size" in shown.out
    assert "  actor_rollout_ref.rollout.tensor_model_parallel_size        = 2" in shown.out.splitlines()


def test_presets_verb_json(cli) -> None:  # type: ignore[no-untyped-def]
    import json

    data = json.loads(cli("presets", "cluster", "--format", "json").out)
    assert data["values"] == EXPECTED["cluster"]
    assert data["hardware"] == "several nodes x 8 GPUs"
    names = [p["name"] for p in json.loads(cli("presets", "--format", "json").out)["presets"]]
    assert names == ["small", "medium", "cluster", "auto"]


def test_presets_verb_unknown_name(cli) -> None:  # type: ignore[no-untyped-def]
    result: CliResult = cli("presets", "huge")
    assert result.code == 2
    assert result.err == (
        "error: unknown preset 'huge'\n  where: command line, argument 2\n  fix: use one of: auto, cluster, medium, small\n"
    )


def test_presets_verb_shows_values_adapted_to_declared_hardware(cli) -> None:  # type: ignore[no-untyped-def]
    result: CliResult = cli(
        "presets",
        "auto",
        "hardware.gpus_per_node=2",
        "hardware.gpu_memory_gb=80",
        f"{ARR}.model.path=Qwen/Qwen2.5-7B-Instruct",
    )
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("preset auto (auto chose small) adapted to: hardware.gpus_per_node=2")
    assert lines[1] == f"  sized for: {ARR}.model.path=Qwen/Qwen2.5-7B-Instruct (7.6B parameters)"
    strategy = next(
        i for i, line in enumerate(lines) if line.split("=")[0].strip() == f"{ARR}.actor.strategy"
    )
    assert lines[strategy].endswith("= fsdp2")
    assert lines[strategy + 1].strip().startswith("adapted: preset small: FSDP2's CPU offload policy")
    plain: CliResult = cli("presets", "auto", "hardware.gpus_per_node=2")
    assert plain.code == 0 and "  trainer.n_gpus_per_node" in plain.out


def test_presets_verb_names_verls_placeholder_model_it_sized_for(cli) -> None:  # type: ignore[no-untyped-def]
    result: CliResult = cli("presets", "medium", "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=24")
    assert result.code == 0, result.err
    assert result.out.splitlines()[1] == (
        f"  sized for: {ARR}.model.path=~/models/deepseek-llm-7b-chat (6.9B parameters), verl's placeholder "
        f"default: pass {ARR}.model.path=... for your model"
    )

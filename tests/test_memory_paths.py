"""Which logits path verl takes (flash-attn cross-entropy or its row-wise fallback) and what each costs."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT, CliResult

from verl_safe_launch.compose import compose
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import ComposeRequest, detect_hardware, load_architecture
from verl_safe_launch.inputs.overrides import cli_tokens, split_tool_tokens
from verl_safe_launch.memory import estimate_memory
from verl_safe_launch.rules import with_values

ARR = "actor_rollout_ref"
QWEN_3B = {
    f"{ARR}.model.path": "Qwen/Qwen2.5-3B",
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu": 8,
}


@functools.cache
def base_view() -> ConfigView:
    return compose(ComposeRequest(config_files=(Path(EXAMPLES / "grpo_6gpu.yaml"),))).view


def context(changes: dict[str, object], flash: bool | None) -> RuleContext:
    view = with_values(base_view(), changes)
    view = ConfigView(dict(view.values), view.provenance)
    arch = load_architecture(view.get(f"{ARR}.model.path"))
    return RuleContext(view, arch, None, HardwareFacts(gpu_memory_gb=80, flash_attn=flash))


def stage_gib(changes: dict[str, object], flash: bool | None, stage: str) -> float:
    est = estimate_memory(context(changes, flash))
    found = est.stage(stage)
    assert found is not None
    return found.get("activations") + found.get("logits and temporaries")


def test_the_token_and_the_environment_decide_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _, tool = split_tool_tokens(cli_tokens(["hardware.flash_attn=false"]))
    assert detect_hardware(tool, {"VSL_HARDWARE_DETECT": "0"}).facts().flash_attn is False
    _, none = split_tool_tokens(cli_tokens([]))
    off = detect_hardware(none, {"VERL_DISABLE_FLASH_ATTN_CE": "1"})
    assert off.flash_attn is not None and off.flash_attn.value is False
    assert "VERL_DISABLE_FLASH_ATTN_CE=1" in off.flash_attn.source.reason
    # whether this Python imports flash_attn says something only where the GPUs are
    assert detect_hardware(none, {}).flash_attn is None
    in_job = detect_hardware(
        none, {"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NUM_NODES": "1"}
    )
    assert (
        in_job.flash_attn is not None
        and "flash_attn is not importable in this Python" in in_job.flash_attn.source.reason
    )
    _, bad = split_tool_tokens(cli_tokens(["hardware.flash_attn=maybe"]))
    with pytest.raises(UsageError, match=r"hardware\.flash_attn=maybe is not true or false"):
        detect_hardware(bad, {})


def test_without_flash_the_update_keeps_another_logits_copy() -> None:
    with_flash = stage_gib({}, True, "actor update")
    without = stage_gib({}, False, "actor update")
    arch = load_architecture("Qwen/Qwen2.5-7B-Instruct")
    assert arch is not None
    tokens = 8 * 1536  # micro 8 × (512 + 1024)
    assert without - with_flash == pytest.approx(2 * tokens * arch.vocab_size / 2**30, rel=0.01)


def test_remove_padding_rows_are_tokens_so_the_log_prob_barely_changes() -> None:
    without, with_flash = stage_gib(QWEN_3B, False, "old log-prob"), stage_gib(QWEN_3B, True, "old log-prob")
    assert with_flash < without < with_flash * 1.001


def test_qwen_3b_padded_log_prob_without_flash_matches_the_trace() -> None:
    """Qwen2.5-3B, 8 × 1024 tokens, 3-D logits into logprobs_from_logits_v2: one sequence's row beside them."""
    padded = {**QWEN_3B, f"{ARR}.model.use_remove_padding": False}
    got = stage_gib(padded, False, "old log-prob")
    assert abs(got - 2.90) <= 0.15 * 2.90  # the figure reported for this case
    cache = json.loads((ROOT / "bench" / "memory_calibration.json").read_text())["cases"]
    traced = cache["Qwen/Qwen2.5-3B|logprob|b8|s1024|ckpt|no_flash_ce_padded"]["traced_total"] / 2**30
    assert got == pytest.approx(traced, rel=0.10)
    # on the flash path the padded batch is first copied to 2-D: the fallback is cheaper here
    assert stage_gib(padded, True, "old log-prob") > got


def test_the_assumptions_say_which_path(
    cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    example = str(EXAMPLES / "grpo_6gpu.yaml")
    r = cli("estimate", "-c", example, "hardware.gpu_memory_gb=80", "hardware.flash_attn=false")
    assert r.code == 0, r.err
    assert "log-probs: verl's logprobs_from_logits_v2" in r.out and "hardware.flash_attn=false" in r.out
    r = cli("estimate", "-c", example, "hardware.gpu_memory_gb=80")
    assert (
        "flash-attn's cross-entropy not assumed, since nothing here tells whether the GPU nodes have" in r.out
    )
    env = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_DISABLE_FLASH_ATTN_CE='1'"
    r = cli("estimate", "-c", example, "hardware.gpu_memory_gb=80", "hardware.flash_attn=true", env)
    assert r.code == 0, r.err
    assert "VERL_DISABLE_FLASH_ATTN_CE=1 in the workers' runtime env" in r.out


def test_update_row_shows_the_micro_batch_peak_beside_the_optimizer_step() -> None:
    """On one GPU the optimizer step can be the larger phase; the micro batch's own peak stays visible."""
    one_gpu = {
        "trainer.n_gpus_per_node": 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu": 1,
    }
    small = estimate_memory(context(one_gpu, True)).stage("actor update")
    larger = estimate_memory(context({**one_gpu, f"{ARR}.actor.ppo_micro_batch_size_per_gpu": 2}, True))
    big = larger.stage("actor update")
    assert small is not None and big is not None
    phases, big_phases = dict(small.phases), dict(big.phases)
    assert small.phase == "optimizer step" and small.total == pytest.approx(phases["optimizer step"])
    assert phases["micro batch"] < phases["end of backward"] < phases["optimizer step"]
    assert big_phases["micro batch"] > phases["micro batch"]  # the micro batch moves its own phase
    assert big_phases["optimizer step"] == pytest.approx(phases["optimizer step"])


GEMMA = {
    f"{ARR}.model.path": "google/gemma-2-2b",
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu": 2,
}


def test_gemma_softcapping_makes_another_logits_copy() -> None:
    """gemma-2-2b, 2 × 1024 tokens: the traced log-prob peak is two bf16 copies of 2048 × 256000 logits."""
    got = stage_gib(GEMMA, True, "old log-prob")
    assert abs(got - 1.96) <= 0.15 * 1.96
    arch = load_architecture("google/gemma-2-2b")
    assert arch is not None and arch.final_logit_softcapping == 30.0
    plain = stage_gib({**GEMMA, f"{ARR}.model.path": "Qwen/Qwen2.5-3B"}, True, "old log-prob")
    assert got > plain  # Qwen2.5-3B has a smaller vocabulary and no softcap


def test_an_untraceable_model_fits_only_when_its_whole_band_does(tmp_path: Path) -> None:
    """transformers cannot build a model_type it does not know: the closest calibrated family (Llama) stands in,
    with the worst error measured for its row on the other families as the band."""
    from verl_safe_launch.memory import memory_findings

    shape = {  # a config.json of a model_type transformers does not ship
        "model_type": "acme_lm",
        "hidden_size": 3072,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 8192,
        "vocab_size": 32064,
    }
    (tmp_path / "config.json").write_text(json.dumps(shape))
    ctx = context({f"{ARR}.model.path": str(tmp_path)}, True)
    assert ctx.actor_arch is not None and ctx.actor_arch.model_type == "acme_lm"
    est = estimate_memory(ctx)
    stage = est.stage("old log-prob")
    assert stage is not None
    assert est.terms.startswith("model code not traceable (ValueError: ")
    assert "closest traced family 'llama' stands in" in est.terms and stage.band > 0.2
    checks = (
        (stage.total * 1.02, "does not fit"),
        (stage.high + 1, "fits"),
        (stage.low - 1, "out of memory"),
    )
    for gpu, verdict in checks:
        hw = HardwareFacts(gpu_memory_gb=gpu, flash_attn=True)
        judged = estimate_memory(RuleContext(ctx.view, ctx.actor_arch, None, hw)).stage("old log-prob")
        assert judged is not None and judged.verdict == verdict, gpu
        assert judged.verdict_text == f"{verdict} (model code not traced)"  # every verdict says so
    hw = HardwareFacts(gpu_memory_gb=stage.total * 1.02, flash_attn=True)
    found = memory_findings(RuleContext(ctx.view, ctx.actor_arch, None, hw))
    assert any(
        f.rule_id == "memory-stage-tight" and "'acme_lm' could not be traced" in f.message for f in found
    )
    roomy = HardwareFacts(gpu_memory_gb=stage.high * 4, flash_attn=True)
    found = memory_findings(RuleContext(ctx.view, ctx.actor_arch, None, roomy))
    untraced = [f for f in found if f.rule_id == "memory-family-untraced"]
    assert len(untraced) == 1 and "old log-prob fits" in untraced[0].message
    low = HardwareFacts(gpu_memory_gb=stage.low - 1, flash_attn=True)
    found = memory_findings(RuleContext(ctx.view, ctx.actor_arch, None, low))
    assert any(
        f.rule_id == "memory-stage-out-of-memory" and "'acme_lm' could not be traced" in f.message
        for f in found
    )


def test_fused_kernels_do_not_depend_on_flash_attn() -> None:
    fused = {f"{ARR}.model.use_fused_kernels": True}
    assert stage_gib(fused, False, "actor update") == stage_gib(fused, True, "actor update")
    lines = estimate_memory(context(fused, False)).assumptions
    assert any(line.startswith("log-probs: fused kernels") for line in lines)

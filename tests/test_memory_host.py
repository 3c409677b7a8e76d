"""Host RAM per node: where the number comes from, what offload and checkpoints put there, and the finding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult

from verl_safe_launch.compose import compose
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.inputs import ComposeRequest, detect_hardware, load_architecture
from verl_safe_launch.inputs.machine import meminfo, slurm_memory
from verl_safe_launch.inputs.overrides import cli_tokens, split_tool_tokens
from verl_safe_launch.memory import GIB, memory_findings, model_params
from verl_safe_launch.memory.estimate import estimate_memory
from verl_safe_launch.rules import with_values

ARR = "actor_rollout_ref"
OFFLOAD = {f"{ARR}.actor.fsdp_config.param_offload": True, f"{ARR}.actor.fsdp_config.optimizer_offload": True}


@functools.cache
def base_view() -> ConfigView:
    return compose(ComposeRequest(config_files=(Path(EXAMPLES / "grpo_6gpu.yaml"),))).view


def context(changes: dict[str, object], host: float | None) -> RuleContext:
    view = with_values(base_view(), changes)
    view = ConfigView(dict(view.values), view.provenance)
    arch = load_architecture(view.get(f"{ARR}.model.path"))
    return RuleContext(
        view, arch, None, HardwareFacts(gpu_memory_gb=80, flash_attn=True, host_memory_gb=host)
    )


@pytest.mark.parametrize(
    ("value", "gib"), [("64000", 62.5), ("512G", 512.0), ("2T", 2048.0), ("0", None), ("lots", None)]
)
def test_slurm_mem_per_node(value: str, gib: float | None) -> None:
    fact = slurm_memory({"SLURM_MEM_PER_NODE": value})
    assert (fact.value if fact else None) == gib


def test_meminfo_and_the_token(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       263854080 kB\nMemFree:        1000 kB\n")
    fact = meminfo(str(path))
    assert fact is not None and fact.value == 251.6 and "MemTotal" in fact.source.reason
    _, tool = split_tool_tokens(cli_tokens(["hardware.host_memory_gb=512"]))
    assert detect_hardware(tool, {"SLURM_MEM_PER_NODE": "64G"}).facts().host_memory_gb == 512.0
    _, none = split_tool_tokens(cli_tokens([]))
    assert detect_hardware(none, {"SLURM_MEM_PER_NODE": "64G"}).facts().host_memory_gb == 64.0


def test_offload_puts_the_actor_shards_in_host_memory() -> None:
    plain = estimate_memory(context({}, 1024)).host
    offloaded = estimate_memory(context(OFFLOAD, 1024)).host
    assert plain is not None and offloaded is not None
    arch = load_architecture("Qwen/Qwen2.5-7B-Instruct")
    assert arch is not None
    fp32 = 4 * model_params(arch) / GIB  # six GPU shards on one node = the whole fp32 model
    assert plain.get("offloaded parameters") == 0
    assert offloaded.get("offloaded parameters") == pytest.approx(fp32, rel=1e-6)
    assert offloaded.get("offloaded optimizer") == pytest.approx(2 * fp32, rel=1e-6)
    assert plain.get("ref parameters") == pytest.approx(
        fp32 / 2, rel=1e-6
    )  # bf16, on the CPU for forward-only
    saving = estimate_memory(context({**OFFLOAD, "trainer.save_freq": 10}, 1024)).host
    assert saving is not None and saving.get("checkpoint save buffers") == pytest.approx(fp32, rel=1e-6)


def test_a_node_too_small_for_the_offloaded_state_is_an_error() -> None:
    findings = memory_findings(context(OFFLOAD, 64))
    [host] = [f for f in findings if f.rule_id.startswith("host-memory")]
    assert host.rule_id == "host-memory-out-of-memory"
    assert host.message.startswith("host RAM per node needs ~")
    assert "offloaded optimizer" in host.message and "of 64 GiB (hardware.host_memory_gb)" in host.message
    assert host.fix == "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"
    assert not [f for f in memory_findings(context(OFFLOAD, 1024)) if f.rule_id.startswith("host-memory")]


def test_estimate_prints_host_ram(cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    args = (
        "-c",
        str(EXAMPLES / "grpo_6gpu.yaml"),
        "hardware.gpu_memory_gb=80",
        "hardware.host_memory_gb=256",
    )
    r = cli("estimate", *args)
    assert r.code == 0, r.err
    assert any(
        line.startswith("host RAM per node: ~") and "of 256 GiB" in line for line in r.out.splitlines()
    )

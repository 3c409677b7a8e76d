"""Hardware detection (tokens, Slurm, a fake nvidia-smi on PATH) and mismatches with the config's GPU counts."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from verl_safe_launch.compose import compose
from verl_safe_launch.errors import UsageError
from verl_safe_launch.findings import Finding
from verl_safe_launch.inputs import (
    ComposeRequest,
    HardwareProfile,
    ToolSettings,
    cli_tokens,
    detect_hardware,
    hardware_findings,
    split_tool_tokens,
)
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.presets import compose_for_launch
from verl_safe_launch.provenance import Layer
from verl_safe_launch.render import render_finding

H100 = "NVIDIA H100 80GB HBM3, 81559\n"


def _tool(*tokens: str) -> ToolSettings:
    return split_tool_tokens(cli_tokens(list(tokens)))[1]


def fake_nvidia_smi(folder: Path, stdout: str, code: int = 0, stderr: str = "") -> dict[str, str]:
    """A fake ``nvidia-smi`` that answers only the exact query verl-safe-launch makes; returns an env with it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" != "--query-gpu=name,memory.total --format=csv,noheader,nounits" ]; then\n'
        "  echo unexpected arguments: $@ >&2; exit 64\nfi\n"
        f"printf '%s' '{stdout}'\nprintf '%s' '{stderr}' >&2\nexit {code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": str(folder)}


def _facts(profile: HardwareProfile) -> tuple[object, ...]:
    f = profile.facts()
    return (f.nodes, f.gpus_per_node, f.gpu_memory_gb, f.gpu_name)


def test_tokens_are_read_with_their_sources() -> None:
    tool = _tool(
        "hardware.nodes=2", "hardware.gpus_per_node=8", "hardware.gpu_memory_gb=80", "hardware.gpu_name=H100"
    )
    profile = detect_hardware(tool, env={})
    assert _facts(profile) == (2, 8, 80.0, "H100")
    assert profile.gpus_per_node is not None
    assert profile.gpus_per_node.source.layer is Layer.HARDWARE
    assert profile.gpus_per_node.source.describe() == (
        "hardware: declared on the command line, argument 2 (hardware.gpus_per_node=8)"
    )


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("hardware.nodes=abc", "hardware.nodes=abc is not a whole number from 1 to 100000"),
        ("hardware.nodes=0", "hardware.nodes=0 is not a whole number from 1 to 100000"),
        ("hardware.gpus_per_node=2.5", "hardware.gpus_per_node=2.5 is not a whole number from 1 to 100000"),
        (
            "hardware.gpu_memory_gb=-1",
            "hardware.gpu_memory_gb=-1 is not a number of GB above 0 and at most 10000",
        ),
        (
            "hardware.gpu_memory_gb=lots",
            "hardware.gpu_memory_gb=lots is not a number of GB above 0 and at most 10000",
        ),
        ("hardware.gpu_name=", "hardware.gpu_name= is not a non-empty name"),
    ],
)
def test_bad_token_values_are_usage_errors(token: str, message: str) -> None:
    with pytest.raises(UsageError) as err:
        detect_hardware(_tool(token), env={})
    assert err.value.what == message
    assert err.value.where == f"command line, argument 1 ({token})"


def test_bad_token_through_the_cli_is_one_compact_message(cli) -> None:  # type: ignore[no-untyped-def]
    result = cli("show", "hardware.nodes=abc")
    assert result.code == 2
    assert result.err == (
        "error: hardware.nodes=abc is not a whole number from 1 to 100000\n"
        "  where: command line, argument 2 (hardware.nodes=abc)\n"
        "  fix: pass e.g. hardware.nodes=2\n"
    )


@pytest.mark.parametrize(
    ("env", "nodes", "gpus", "reason"),
    [
        (
            {"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "6"},
            2,
            6,
            "Slurm allocation, SLURM_GPUS_ON_NODE=6",
        ),
        ({"SLURM_NNODES": "3", "SLURM_GPUS_PER_NODE": "4"}, 3, 4, "Slurm allocation, SLURM_GPUS_PER_NODE=4"),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, None, 4, "Slurm allocation, SLURM_GPUS_PER_NODE=a100:4"),
        ({"SLURM_JOB_GPUS": "0,1,2"}, None, 3, "Slurm allocation, SLURM_JOB_GPUS=0,1,2"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, None, 2, "visible GPUs, CUDA_VISIBLE_DEVICES=0,1"),
    ],
)
def test_slurm_allocation(env: dict[str, str], nodes: int | None, gpus: int, reason: str) -> None:
    profile = detect_hardware(ToolSettings(), env=env)
    assert (profile.facts().nodes, profile.facts().gpus_per_node) == (nodes, gpus)
    assert profile.gpus_per_node is not None and profile.gpus_per_node.source.reason == reason


def test_slurm_gpu_type_names_the_gpu() -> None:
    assert detect_hardware(ToolSettings(), env={"SLURM_GPUS_PER_NODE": "a100:4"}).facts().gpu_name == "a100"


def test_visible_devices_disagreeing_with_slurm_is_a_note() -> None:
    profile = detect_hardware(ToolSettings(), env={"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert profile.facts().gpus_per_node == 4
    assert profile.notes == (
        "CUDA_VISIBLE_DEVICES shows 2 GPUs but Slurm allocation, SLURM_GPUS_ON_NODE=4 says 4; planning for 4",
    )


def test_empty_visible_devices_hides_every_gpu() -> None:
    profile = detect_hardware(ToolSettings(), env={"CUDA_VISIBLE_DEVICES": ""})
    assert profile.facts().gpus_per_node is None
    assert profile.notes == ("CUDA_VISIBLE_DEVICES= hides every GPU from this process",)


def test_nvidia_smi_on_path(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", H100 * 8)
    profile = detect_hardware(ToolSettings(), env=env)
    assert _facts(profile) == (None, 8, 79.6, "NVIDIA H100 80GB HBM3")
    assert profile.gpu_memory_gb is not None
    assert profile.gpu_memory_gb.source.reason == "nvidia-smi, 8 × NVIDIA H100 80GB HBM3 (79.6 GiB each)"
    assert profile.notes == ()


def test_mixed_gpus_warn_and_plan_for_the_smallest(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", H100 * 2 + "NVIDIA A100-SXM4-40GB, 40960\n")
    profile = detect_hardware(ToolSettings(), env=env)
    assert _facts(profile) == (None, 3, 40.0, "NVIDIA A100-SXM4-40GB")
    assert profile.notes == (
        "mixed GPU types on this machine (1 × NVIDIA A100-SXM4-40GB, 2 × NVIDIA H100 80GB HBM3): "
        "planning for the smallest, NVIDIA A100-SXM4-40GB",
    )
    findings = hardware_findings(
        compose(ComposeRequest(overrides=cli_tokens(["trainer.n_gpus_per_node=3"]))).view, profile
    )
    assert [(f.rule_id, f.severity.value) for f in findings] == [("hardware-detect", "warning")]


def test_visible_devices_select_nvidia_smi_rows(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", "NVIDIA A100-SXM4-40GB, 40960\n" + H100 * 3)
    env["CUDA_VISIBLE_DEVICES"] = "1,2"
    profile = detect_hardware(ToolSettings(), env=env)
    assert _facts(profile) == (None, 2, 79.6, "NVIDIA H100 80GB HBM3")
    assert profile.gpus_per_node is not None and profile.gpus_per_node.source.reason == (
        "visible GPUs, CUDA_VISIBLE_DEVICES=1,2"
    )


def test_failing_nvidia_smi_is_a_note_not_a_crash(tmp_path: Path) -> None:
    msg = "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver."
    env = fake_nvidia_smi(tmp_path / "bin", "", code=9, stderr=msg)
    profile = detect_hardware(ToolSettings(), env=env)
    assert _facts(profile) == (None, None, None, None)
    assert profile.notes == (f"nvidia-smi failed: {msg}",)


def test_order_of_trust_tokens_then_slurm_then_nvidia_smi(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", H100 * 8)
    env.update({"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NUM_NODES": "2"})
    assert _facts(detect_hardware(ToolSettings(), env=env)) == (2, 4, 79.6, "NVIDIA H100 80GB HBM3")
    tool = _tool("hardware.gpus_per_node=2", "hardware.gpu_memory_gb=40")
    assert _facts(detect_hardware(tool, env=env)) == (2, 2, 40.0, "NVIDIA H100 80GB HBM3")


def test_detection_can_be_turned_off(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", H100)
    env.update({"SLURM_GPUS_ON_NODE": "4", "VSL_HARDWARE_DETECT": "0"})
    assert _facts(detect_hardware(_tool("hardware.nodes=1"), env=env)) == (1, None, None, None)


def test_hardware_fills_unset_gpu_counts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "6")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    view = compose_for_launch(ComposeRequest()).view
    assert view.get("trainer.n_gpus_per_node") == 6
    prov = view.prov("trainer.n_gpus_per_node")
    assert prov is not None
    assert prov.source.describe() == "hardware: Slurm allocation, SLURM_GPUS_ON_NODE=6"
    assert [w.value for w in prov.history] == [8]


def _mismatch(*overrides: str, env: dict[str, str]) -> list[Finding]:
    composed = compose(ComposeRequest(overrides=cli_tokens(list(overrides))))
    profile = detect_hardware(composed.tool, env=env)
    return [f for f in run_preflight(composed, profile).findings if f.rule_id == "hardware-mismatch"]


def test_more_gpus_than_the_allocation_is_an_error() -> None:
    env = {"SLURM_GPUS_ON_NODE": "6", "SLURM_JOB_NUM_NODES": "1"}
    (finding,) = _mismatch("trainer.n_gpus_per_node=8", env=env)
    assert (
        render_finding(finding)
        == (
            "error [hardware-mismatch] trainer.n_gpus_per_node=8 asks for more GPUs per node than the hardware has (6)\n"
            "  trainer.n_gpus_per_node = 8      from command line, argument 1 (trainer.n_gpus_per_node=8)\n"
            "  hardware.gpus_per_node  = 6      from hardware: Slurm allocation, SLURM_GPUS_ON_NODE=6\n"
            "  fix: trainer.n_gpus_per_node=6 data.train_batch_size=1026 actor_rollout_ref.actor.ppo_mini_batch_size=258 "
            "critic.ppo_mini_batch_size=258 (or leave it unset: verl-safe-launch fills it from the hardware)\n"
            "  see: verl-safe-launch explain hardware-mismatch"
        )
    )  # 6 GPUs alone would break verl's defaults (1024 sequences over 6 GPUs): the fix is re-checked as a whole


def test_more_nodes_than_the_allocation_is_an_error() -> None:
    env = {"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NUM_NODES": "2"}
    (finding,) = _mismatch("trainer.nnodes=4", "trainer.n_gpus_per_node=8", env=env)
    assert finding.severity.value == "error"
    assert finding.message == "trainer.nnodes=4 asks for more nodes than the hardware has (2)"
    assert [(k, v, s.describe()) for k, v, s in finding.sources] == [
        ("trainer.nnodes", 4, "command line, argument 1 (trainer.nnodes=4)"),
        ("hardware.nodes", 2, "hardware: Slurm allocation, SLURM_JOB_NUM_NODES=2"),
    ]


def test_fewer_gpus_than_visible_is_a_warning(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", H100 * 8)
    (finding,) = _mismatch("trainer.n_gpus_per_node=6", env=env)
    assert render_finding(finding) == (
        "warning [hardware-mismatch] trainer.n_gpus_per_node=6 uses fewer GPUs per node than the hardware has "
        "(8); the rest stay idle\n"
        "  trainer.n_gpus_per_node = 6      from command line, argument 1 (trainer.n_gpus_per_node=6)\n"
        "  hardware.gpus_per_node  = 8      from hardware: nvidia-smi, 8 × NVIDIA H100 80GB HBM3 (79.6 GiB each)\n"
        "  fix: trainer.n_gpus_per_node=8, or declare hardware.gpus_per_node=6 if leaving them idle is intended\n"
        "  see: verl-safe-launch explain hardware-mismatch"
    )


def test_matching_counts_and_filled_counts_are_no_mismatch() -> None:
    env = {"SLURM_GPUS_ON_NODE": "8"}
    assert _mismatch("trainer.n_gpus_per_node=8", env=env) == []
    assert _mismatch(env=env) == []


def test_unknown_hardware_still_runs_and_names_the_tokens() -> None:
    composed = compose(ComposeRequest())
    findings = run_preflight(composed, detect_hardware(composed.tool, env={})).findings
    (unknown,) = [f for f in findings if f.rule_id == "hardware-unknown"]
    assert render_finding(unknown) == (
        "info [hardware-unknown] GPUs per node and GPU memory unknown (not declared, no Slurm allocation or "
        "nvidia-smi detected): GPU counts come from the config and memory verdicts say 'unknown'\n"
        "  fix: declare the hardware, e.g. hardware.gpus_per_node=8 hardware.gpu_memory_gb=80\n"
        "  see: verl-safe-launch explain hardware-unknown"
    )


def test_verl_default_gpu_count_against_the_hardware_is_an_error() -> None:
    # Without verl-safe-launch's fills (e.g. inside verl's own entry point) verl's default 8 stays.
    (finding,) = _mismatch(env={"SLURM_GPUS_ON_NODE": "4"})
    assert (
        finding.message == "trainer.n_gpus_per_node=8 asks for more GPUs per node than the hardware has (4)"
    )
    assert finding.fix == "trainer.n_gpus_per_node=4 (verl's default does not match the hardware)"


@pytest.mark.parametrize(
    ("visible", "gpus", "bad"),
    [
        ("0,2,-1,1", 2, "'-1'"),
        ("0,abc,1", 1, "'abc'"),
        ("GPU-8f3c1a2e,1", 2, None),
        ("MIG-GPU-8f3c1a2e/1/0", 1, None),
        ("0,,1", 1, "an empty entry"),
        ("nvidia0", None, "'nvidia0'"),
    ],
)
def test_invalid_visible_devices_are_not_counted(visible: str, gpus: int | None, bad: str | None) -> None:
    """CUDA enumerates the entries before the first invalid one (CUDA_VISIBLE_DEVICES=0,2,-1,1 shows 0 and 2)."""
    profile = detect_hardware(ToolSettings(), env={"CUDA_VISIBLE_DEVICES": visible})
    assert profile.facts().gpus_per_node == gpus
    if bad is None:
        assert profile.notes == ()
    else:
        (note,) = profile.notes
        assert note.startswith(f"CUDA_VISIBLE_DEVICES={visible}: {bad} is not a device")
        assert note.endswith(
            f"so {gpus or 0} GPU{'' if gpus == 1 else 's'} {'is' if gpus == 1 else 'are'} visible"
        )


def test_an_index_past_the_last_gpu_ends_the_visible_list(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", H100 * 2)
    env["CUDA_VISIBLE_DEVICES"] = "1,5,0"
    profile = detect_hardware(ToolSettings(), env=env)
    assert profile.facts().gpus_per_node == 1

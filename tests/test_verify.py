"""Verdicts only as strong as what was read: "cannot verify" findings, the unverified verdict, --strict."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.audit import CANNOT_VERIFY, depends_on
from verl_safe_launch.findings import Finding, Severity

Cli = Callable[..., CliResult]
ARR = "actor_rollout_ref"
LAUNCH = "python3 -m verl.trainer.main_ppo"
BASE = (
    "data.train_files=/d/train.parquet data.val_files=/d/test.parquet "
    f"{ARR}.model.path=Qwen/Qwen2.5-0.5B-Instruct {ARR}.actor.ppo_mini_batch_size=8 "
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=1 {ARR}.rollout.log_prob_micro_batch_size_per_gpu=1 "
    f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=1 "
    "data.train_batch_size=16 trainer.n_gpus_per_node=8 trainer.nnodes=1 algorithm.adv_estimator=grpo"
)


def audit_json(cli: Cli, tmp_path: Path, text: str, *extra: str) -> tuple[int, dict[str, object]]:
    script = tmp_path / "run.sh"
    script.write_text(text)
    result = cli("audit", "--format", "json", *extra, str(script))
    return result.code, json.loads(result.out)


def launch_of(report: dict[str, object]) -> dict[str, object]:
    scripts = report["scripts"]
    assert isinstance(scripts, list)
    launches = scripts[0]["launches"]
    assert len(launches) == 1
    return dict(launches[0])


def rules(launch: dict[str, object], severity: str) -> list[str]:
    findings = launch["findings"]
    assert isinstance(findings, list)
    return [f["rule_id"] for f in findings if f["severity"] == severity]


def messages(launch: dict[str, object], rule_id: str) -> list[str]:
    findings = launch["findings"]
    assert isinstance(findings, list)
    return [f["message"] for f in findings if f["rule_id"] == rule_id]


# --- each unread part turns exactly the findings it could change into "cannot verify" ----------------------

CASES = [
    pytest.param(
        f"A=({BASE})\ncase $B in\n  v) A+=({ARR}.rollout.name=vllm) ;;\n  s) A+=({ARR}.rollout.name=sglang) ;;\n"
        f'esac\n{LAUNCH} "${{A[@]}}"\n',
        "missing-required",
        f"{ARR}.rollout.name has no value",
        id="key-in-case-appended-array",
    ),
    pytest.param(
        f"A=({BASE} {ARR}.rollout.name=vllm {ARR}.actor.megatron.tensor_model_parallel_size=2)\n"
        f'if [ -n "$M" ]; then\n  A+=(model_engine=megatron)\nfi\n{LAUNCH} "${{A[@]}}"\n',
        "unknown-key",
        f"unknown key {ARR}.actor.megatron.tensor_model_parallel_size",
        id="engine-in-if-extended-array",
    ),
    pytest.param(
        f"{LAUNCH} {BASE.replace('ppo_mini_batch_size=8', 'ppo_epochs=1')} {ARR}.rollout.name=vllm "
        f"{ARR}.actor.ppo_mini_batch_size=$(cat mini.txt)\n",
        "batch",
        "ppo_mini_batch_size",
        id="batch-size-from-command-substitution",
    ),
]


@pytest.mark.parametrize(("text", "rule", "message"), CASES)
def test_unread_part_makes_dependent_finding_cannot_verify(
    cli: Cli, tmp_path: Path, text: str, rule: str, message: str
) -> None:
    code, report = audit_json(cli, tmp_path, text)
    launch = launch_of(report)
    assert code == 0, launch["findings"]
    assert (report["verdict"], launch["verdict"]) == ("unverified", "unverified")
    assert rules(launch, "error") == []
    unverified = messages(launch, CANNOT_VERIFY)
    assert any(f"[{rule}" in m and message in m for m in unverified), unverified
    assert all("is not read and could change it" in m for m in unverified)


def test_the_same_launch_fully_read_is_judged(cli: Cli, tmp_path: Path) -> None:
    text = f"A=({BASE} {ARR}.actor.megatron.tensor_model_parallel_size=2 {ARR}.rollout.name=vllm)\n"
    code, report = audit_json(cli, tmp_path, f'{text}{LAUNCH} "${{A[@]}}"\n')
    launch = launch_of(report)
    assert (code, launch["verdict"], launch["unread"]) == (1, "no-go", 0)
    assert "unknown-key" in rules(launch, "error")
    assert messages(launch, CANNOT_VERIFY) == []


def test_a_value_written_after_an_opaque_word_is_still_judged(cli: Cli, tmp_path: Path) -> None:
    text = f"{LAUNCH} {BASE} $EXTRA {ARR}.rollout.name=vllm {ARR}.rollout.n=0\n"
    code, report = audit_json(cli, tmp_path, text)
    launch = launch_of(report)
    assert code == 1
    assert "value-range" in rules(launch, "error")


def test_unrelated_findings_stay_errors(cli: Cli, tmp_path: Path) -> None:
    text = f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm {ARR}.rollout.n=0 trainer.project_name=$(whoami)\n"
    code, report = audit_json(cli, tmp_path, text)
    launch = launch_of(report)
    assert (code, launch["verdict"], launch["unread"]) == (1, "no-go", 1)
    assert "value-range" in rules(launch, "error")


def test_unverified_text_verdict_and_strict(cli: Cli, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm trainer.project_name=$(whoami)\n")
    result = cli("audit", str(script))
    assert result.code == 0
    assert result.out.splitlines()[-1].startswith("UNVERIFIED: 1 part not read; 0 errors")
    assert cli("audit", "--strict", str(script)).code == 1


def test_go_only_when_everything_was_read(cli: Cli, tmp_path: Path) -> None:
    code, report = audit_json(cli, tmp_path, f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm\n")
    assert (code, report["verdict"]) == (0, "go")
    assert launch_of(report)["unread"] == 0


def test_findings_depend_on_their_keys_and_cited_values() -> None:
    finding = Finding("r", Severity.ERROR, ("a.b",), "m", None, (("c.d", 1, None),))  # type: ignore[arg-type]
    assert depends_on(finding) == ("a.b", "c.d")

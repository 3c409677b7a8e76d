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
    "data.train_batch_size=16 trainer.n_gpus_per_node=8 trainer.nnodes=1 algorithm.adv_estimator=grpo "
    f"{ARR}.rollout.n=2"
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
    assert all(
        "is not read and could change it" in m or "this holds only where the " in m for m in unverified
    )


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
    assert (code, launch["verdict"], launch["unread"]) == (1, "no-go", 0)
    assert "value-range" in rules(launch, "error")


def test_unverified_text_verdict_and_strict(cli: Cli, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm {ARR}.rollout.n=$(nproc)\n")
    result = cli("audit", str(script))
    assert result.code == 0
    *_, verdict_line, way_forward = result.out.splitlines()
    assert verdict_line.startswith("UNVERIFIED: 1 part not read; 0 errors")
    assert (
        way_forward
        == f"to settle it, audit with the values the run gets: verl-safe-launch audit --trace {script}"
    )
    assert cli("audit", "--strict", str(script)).code == 1


@pytest.mark.parametrize(
    ("unread", "verdict"),
    [
        ("trainer.project_name=$(whoami)", "go"),  # no check reads it: it decides nothing
        ('trainer.experiment_name="$NAME"', "go"),
        ("trainer.default_local_dir=$CKPT", "go"),
        (f"{ARR}.rollout.n=$N", "unverified"),  # the batch arithmetic reads it
        ("data.train_batch_size=$(cat bs)", "unverified"),
        ("trainer.n_gpus_per_node=$GPUS", "unverified"),
        ("data.train_files=$TRAIN", "unverified"),  # the data check reads the file it names
        ("$EXTRA", "unverified"),  # a word: any override
        ("model_engine=$ENGINE", "unverified"),  # a config group
    ],
)
def test_unverified_only_where_an_unread_value_decides_a_check(
    cli: Cli, tmp_path: Path, unread: str, verdict: str
) -> None:
    """UNVERIFIED names an outside value some check reads; one nothing reads leaves the verdict GO.

    For the GO cases, values of several shapes written out in place of the unread one give no finding either.
    """
    code, report = audit_json(cli, tmp_path, f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm {unread}\n")
    launch = launch_of(report)
    assert (code, launch["verdict"]) == (0, verdict), launch["findings"]
    assert "script-unresolved" in rules(launch, "info") or unread.startswith("$")
    if verdict == "go":  # any value written there leaves the findings alone (these keys are strings to verl)

        def judged(extra: str) -> list[tuple[str, str]]:
            _code, other = audit_json(cli, tmp_path, f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm {extra}\n")
            return [
                (f["rule_id"], f["message"]) for f in launch_of(other)["findings"] if f["severity"] != "info"
            ]

        without = judged("")
        key = unread.split("=")[0]
        assert all(judged(f"{key}={value}") == without for value in ("x", "/nonexistent/dir", "a-b_c.d"))


def test_go_only_when_everything_was_read(cli: Cli, tmp_path: Path) -> None:
    code, report = audit_json(cli, tmp_path, f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm\n")
    assert (code, report["verdict"]) == (0, "go")
    assert launch_of(report)["unread"] == 0


def test_findings_depend_on_their_keys_and_cited_values() -> None:
    finding = Finding("r", Severity.ERROR, ("a.b",), "m", None, (("c.d", 1, None),))  # type: ignore[arg-type]
    assert depends_on(finding) == ("a.b", "c.d")


# --- one launch's own later values, and Hydra's '+' rule ---------------------------------------------------


def test_shared_value_replaced_on_the_launch_line_is_info(cli: Cli, tmp_path: Path) -> None:
    text = f"A=({BASE} {ARR}.rollout.name=vllm {ARR}.actor.use_kl_loss=True)\n"
    code, report = audit_json(cli, tmp_path, f'{text}{LAUNCH} "${{A[@]}}" {ARR}.actor.use_kl_loss=False\n')
    launch = launch_of(report)
    assert code == 0
    assert "duplicate-key" in rules(launch, "info") and "duplicate-key" not in rules(launch, "warning")
    assert "looks deliberate" in messages(launch, "duplicate-key")[0]


def test_two_values_on_the_launch_line_are_a_warning_that_strict_refuses(cli: Cli, tmp_path: Path) -> None:
    """Hydra keeps the last value and verl runs with it: not a NO-GO, but --strict (a CI gate) blocks it."""
    text = f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm {ARR}.actor.use_kl_loss=True {ARR}.actor.use_kl_loss=False\n"
    code, report = audit_json(cli, tmp_path, text)
    assert code == 0
    assert "duplicate-key" in rules(launch_of(report), "warning")
    script = tmp_path / "strict.sh"
    script.write_text(text)
    assert cli("audit", str(script), "--strict").code == 1


def test_explicit_value_emptied_by_an_unset_variable_is_reported(cli: Cli, tmp_path: Path) -> None:
    text = f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm trainer.val_before_train=True trainer.val_before_train=${{NEVER}}\n"
    code, report = audit_json(cli, tmp_path, text)
    launch = launch_of(report)
    assert code == 0 and "script-emptied-value" in rules(launch, "warning")
    assert messages(launch, "script-emptied-value") == [
        "trainer.val_before_train=True (line 1) is replaced by trainer.val_before_train=${NEVER} (line 1); the "
        "script never sets $NEVER, so unless the environment does, Hydra gets 'trainer.val_before_train=' and "
        "the value becomes ''"
    ]


@pytest.mark.parametrize(
    "token",
    [f"+{ARR}.rollout.name=vllm", "+trainer.logger=[console]", "+trainer.max_actor_ckpt_to_keep=2"],
)
def test_plus_on_a_null_missing_or_merged_value_is_accepted(cli: Cli, tmp_path: Path, token: str) -> None:
    """Hydra 1.3 accepts '+key=v' where the value is null or '???', or where v is a list or dict."""
    name = "" if "rollout.name" in token else f"{ARR}.rollout.name=vllm"
    _code, report = audit_json(cli, tmp_path, f"{LAUNCH} {BASE} {name} {token}\n")
    assert "unknown-key" not in rules(launch_of(report), "error")
    shown = cli("show", *BASE.split(), *name.split(), token, "--key", "trainer.logger")
    assert shown.code == 0, shown.err


def test_plus_on_a_set_value_is_refused_everywhere(cli: Cli, tmp_path: Path) -> None:
    code, report = audit_json(
        cli, tmp_path, f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm +data.train_batch_size=8\n"
    )
    assert (code, rules(launch_of(report), "error")) == (1, ["unknown-key"])
    assert cli("show", "+data.train_batch_size=8").code == 2


@pytest.mark.parametrize("value", ["{a.b:{}}", "{model.visual.blocks:{}}"])
def test_dict_value_with_dotted_keys_composes(cli: Cli, tmp_path: Path, value: str) -> None:
    token = f"+{ARR}.actor.fsdp_config.fsdp_plan.apply_modules={value}"
    code, report = audit_json(cli, tmp_path, f"{LAUNCH} {BASE} {ARR}.rollout.name=vllm {token}\n")
    assert code in (0, 1)
    assert report["scripts"][0]["error"] is None  # type: ignore[index]


def test_named_config_inheriting_megatron_judges_megatron_keys(cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    text = f"{LAUNCH} --config-path={tmp_path} --config-name=mine {BASE} {ARR}.rollout.name=vllm "
    good = f"{ARR}.actor.megatron.tensor_model_parallel_size=2"
    code, report = audit_json(cli, tmp_path, text + good + "\n")
    assert (code, launch_of(report)["verdict"]) == (0, "go")
    code, report = audit_json(cli, tmp_path, text + f"{ARR}.actor.megatron.tensor_model_parallel_sise=2\n")
    assert rules(launch_of(report), "error") == ["unknown-key"]


def test_unreadable_named_config_makes_key_findings_cannot_verify(cli: Cli, tmp_path: Path) -> None:
    text = f"{LAUNCH} --config-path=$(pwd)/conf --config-name=mine {BASE} {ARR}.actor.megatron.x=2\n"
    code, report = audit_json(cli, tmp_path, text)
    launch = launch_of(report)
    assert (code, launch["verdict"]) == (0, "unverified")
    assert any("[unknown-key]" in m for m in messages(launch, CANNOT_VERIFY))


def test_one_root_cause_one_finding(cli: Cli) -> None:
    """strategy=megatron without model_engine=megatron: one error, and no megatron node judged under dp."""
    result = cli(
        "check",
        "--format",
        "json",
        *BASE.split(),
        f"{ARR}.rollout.name=vllm",
        f"{ARR}.actor.strategy=megatron",
    )
    errors = [f["rule_id"] for f in json.loads(result.out)["findings"] if f["severity"] == "error"]
    assert errors == ["engine-mismatch"]


def test_named_teachers_added_with_plus_are_not_judged_as_an_empty_pool(cli: Cli) -> None:
    teachers = [
        f"+distillation.teacher_models.{name}.{key}={value}"
        for name in ("math", "code")
        for key, value in (("model_path", "Qwen/Qwen3-4B"), ("key", name))
    ]
    args = [*BASE.split(), f"{ARR}.rollout.name=vllm", "distillation.enabled=True", "distillation.nnodes=1"]
    result = cli("check", "--format", "json", *args, *teachers)
    findings = json.loads(result.out)["findings"]
    assert [f for f in findings if f["severity"] != "info" and "teacher" in f["message"]] == []

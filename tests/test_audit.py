"""The audit rules: one row per rule with its exact message, plus the tables checked against the installed verl."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import DATA, check_golden

from verl_safe_launch.audit import (
    ALIASES,
    AUDIT_RULES,
    IGNORED,
    audit,
    covered,
    script_findings,
    yaml_deprecations,
)
from verl_safe_launch.compose import Composed, Overlay, compose, preset_dir
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens, key_facts
from verl_safe_launch.render import render_findings_text
from verl_safe_launch.shell import read_script

OVERLAY = Overlay()
ARR = "actor_rollout_ref"
NAME = f"{ARR}.rollout.name=vllm"
SCRIPTS = DATA / "scripts"


def composed(*overrides: str, files: tuple[Path, ...] = ()) -> Composed:
    request = ComposeRequest(overrides=cli_tokens(list(overrides)), config_files=files, lenient=True)
    return OVERLAY.compose(request)


def run(*overrides: str, files: tuple[Path, ...] = ()) -> list[Finding]:
    return audit(composed(*overrides, files=files))


@dataclass(frozen=True)
class Case:
    rule: str
    overrides: tuple[str, ...]
    severity: Severity
    message: str
    fix: str


CASES = [
    Case(
        "duplicate-key",
        ("trainer.nnodes=1", NAME, "trainer.nnodes=2"),
        Severity.WARNING,
        "trainer.nnodes is set 2 times in the command line: 1 (argument 1), then 2 (argument 3); "
        "Hydra silently keeps the last, 2",
        "keep one: trainer.nnodes=2 (delete argument 1), or trainer.nnodes=1 (delete argument 3)",
    ),
    Case(
        "duplicate-key",
        ("trainer.nnodes=2", NAME, "trainer.nnodes=2"),
        Severity.INFO,
        "trainer.nnodes is set 2 times in the command line, each time to 2 (argument 1, argument 3)",
        "delete the repeat on argument 1",
    ),
    Case(
        "duplicate-key",
        ("model_engine=megatron", NAME, "model_engine=dp"),
        Severity.WARNING,
        "model_engine is set 2 times in the command line: megatron (argument 1), then dp (argument 3); "
        "Hydra silently keeps the last, dp",
        "keep one: model_engine=dp (delete argument 1), or model_engine=megatron (delete argument 3)",
    ),
    Case(
        "unknown-key",
        ("data.train_bach_size=3", NAME),
        Severity.ERROR,
        "unknown key data.train_bach_size: verl 0.9.1's config has no such key, "
        "so Hydra refuses 'data.train_bach_size=3'",
        "did you mean data.train_batch_size? data.train_batch_size=3",
    ),
    Case(
        "unknown-key",
        ("+data.train_batch_size=3", NAME),
        Severity.ERROR,
        "'+data.train_batch_size=3' cannot add data.train_batch_size: verl's config already has it, "
        "so Hydra refuses the '+'",
        "data.train_batch_size=3",
    ),
    Case(
        "unknown-key",
        (f"{ARR}.rollout.enable_sleep_mode=false", NAME),
        Severity.ERROR,
        f"{ARR}.rollout.enable_sleep_mode is a field of RolloutConfig that verl's YAML does not list, "
        f"so Hydra refuses '{ARR}.rollout.enable_sleep_mode=false' without '+'",
        f"+{ARR}.rollout.enable_sleep_mode=false",
    ),
    Case(
        "lookalike-key",
        ("++trainer.tot\u0430l_epochs=3", NAME),
        Severity.ERROR,
        "trainer.tot\u0430l_epochs prints like trainer.total_epochs but holds U+0430 CYRILLIC SMALL LETTER A, so "
        "Hydra adds it as a new key that nothing reads and trainer.total_epochs keeps its value",
        "trainer.total_epochs=3",
    ),
    Case(
        "new-key",
        ("++trainer.my_custom_flag=1", NAME),
        Severity.WARNING,
        "trainer.my_custom_flag is neither in verl 0.9.1's config nor a field of its config dataclasses, "
        "so nothing in verl reads it",
        "remove trainer.my_custom_flag (nothing reads it)",
    ),
    Case(
        "dataclass-field",
        (f"+{ARR}.rollout.enable_sleep_mode=false", NAME),
        Severity.INFO,
        f"{ARR}.rollout.enable_sleep_mode is a field of RolloutConfig (bool, default True) that verl's YAML "
        "does not list; adding it with '+' is allowed and verl passes it to the dataclass",
        "nothing to do",
    ),
    Case(
        "deprecated-alias",
        (
            f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_micro_batch_size=64",
            f"{ARR}.actor.ppo_micro_batch_size_per_gpu=8",
            NAME,
        ),
        Severity.WARNING,
        f"both the deprecated {ARR}.actor.ppo_micro_batch_size=64 (argument 2) and its replacement "
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu=8 (argument 3) are set; verl checks the pair only while "
        f"{ARR}.actor.use_dynamic_bsz is false, so it ignores {ARR}.actor.ppo_micro_batch_size",
        f"delete {ARR}.actor.ppo_micro_batch_size and keep {ARR}.actor.ppo_micro_batch_size_per_gpu=8",
    ),
    Case(
        "deprecated-alias",
        (
            f"{ARR}.model.lora_rank=8",
            f"{ARR}.actor.use_kl_loss=True",
            f"{ARR}.ref.log_prob_micro_batch_size=64",
            NAME,
        ),
        Severity.WARNING,
        f"{ARR}.ref.log_prob_micro_batch_size=64 is deprecated: verl 0.9.1 accepts it in validate_config, "
        "then stops with a bare AssertionError when the workers start (this run does not use that model, so it "
        "stays harmless)",
        f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=8 (the global 64 over 8 GPUs)",
    ),
    Case(
        "deprecated-alias",
        (f"{ARR}.actor.ulysses_sequence_parallel_size=2", NAME),
        Severity.WARNING,
        f"{ARR}.actor.ulysses_sequence_parallel_size=2 is deprecated: verl 0.9.1 still copies it into "
        "fsdp_config when it is above 1",
        f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size=2",
    ),
    Case(
        "deprecated-alias",
        (f"+{ARR}.actor.optim.grad_clip=0.5", f"{ARR}.actor.optim.clip_grad=2.0", NAME),
        Severity.ERROR,
        f"both the deprecated {ARR}.actor.optim.grad_clip=0.5 (argument 1) and its replacement "
        f"{ARR}.actor.optim.clip_grad=2.0 (argument 2) are set; the deprecated grad_clip silently wins",
        f"delete {ARR}.actor.optim.grad_clip and keep {ARR}.actor.optim.clip_grad=2.0",
    ),
    Case(
        "ignored-key",
        ("reward_model.enable=True", NAME),
        Severity.WARNING,
        "reward_model.enable=true has no effect in verl 0.9.1: main_ppo ignores the legacy top-level "
        "reward_model.* keys (only the fully async entry point migrates them)",
        "reward.reward_model.enable=true",
    ),
    Case(
        "ignored-key",
        ("trainer.balance_batch=False", NAME),
        Severity.WARNING,
        "trainer.balance_batch=false has no effect in verl 0.9.1: the V1 trainer always balances batches",
        "remove it (the V1 trainer ignores it)",
    ),
    Case(
        "ignored-key",
        (f"{ARR}.rollout.mode=sync", NAME),
        Severity.ERROR,
        f"{ARR}.rollout.mode=sync is not supported by verl 0.9.1: rollout mode 'sync' was removed; the rollout "
        "workers raise ValueError when they start",
        f"{ARR}.rollout.mode=async",
    ),
    Case(
        "deprecated-key",
        ("global_profiler.global_tool_config.precision_debugger.steps=[1,2]", NAME),
        Severity.WARNING,
        "global_profiler.global_tool_config.precision_debugger.steps=[1, 2]: verl's own config marks it "
        'deprecated ("Deprecated and ignored. Use global_profiler.steps.")',
        "use global_profiler.steps instead",
    ),
    Case(
        "type-mismatch",
        ("data.train_batch_size=abc", NAME),
        Severity.ERROR,
        "data.train_batch_size expects an integer (verl's default), got 'abc' (a string)",
        "data.train_batch_size=1024 (verl's default)",
    ),
    Case(
        "type-mismatch",
        ("trainer.n_gpus_per_node=4.0", NAME),
        Severity.ERROR,
        "trainer.n_gpus_per_node expects an integer (verl's default), got 4.0 (a float)",
        "trainer.n_gpus_per_node=4",
    ),
    Case(
        "type-mismatch",
        (f"{ARR}.rollout.n=[2,4]", NAME),
        Severity.ERROR,
        f"{ARR}.rollout.n expects an integer (RolloutConfig.n: int), got [2, 4] (a list)",
        f"{ARR}.rollout.n=1 (verl's default)",
    ),
    Case(
        "bool-as-string",
        ("trainer.val_before_train='false'", NAME),
        Severity.ERROR,
        "trainer.val_before_train expects true or false, got the string 'false'; any non-empty string is true "
        "in Python, so verl would read it as true",
        "trainer.val_before_train=false (without quotes)",
    ),
    Case(
        "value-range",
        (f"{ARR}.actor.ppo_mini_batch_size=0", NAME),
        Severity.ERROR,
        f"{ARR}.actor.ppo_mini_batch_size=0 must be at least 1",
        f"{ARR}.actor.ppo_mini_batch_size=256",
    ),
    Case(
        "value-range",
        (f"{ARR}.rollout.gpu_memory_utilization=1.5", NAME),
        Severity.ERROR,
        f"{ARR}.rollout.gpu_memory_utilization=1.5 must be a fraction in (0, 1]",
        f"{ARR}.rollout.gpu_memory_utilization=0.5",
    ),
    Case(
        "missing-required",
        ("data.train_batch_size=64",),
        Severity.ERROR,
        f"{ARR}.rollout.name has no value: verl 0.9.1 leaves it mandatory ('???') and fails when it is read",
        f"{ARR}.rollout.name=vllm (or sglang, trtllm)",
    ),
    Case(
        "engine-mismatch",
        (f"{ARR}.actor.strategy=megatron", NAME),
        Severity.ERROR,
        f"{ARR}.actor.strategy=megatron needs model_engine=megatron, but this run composes model_engine=dp, "
        "whose config has no megatron settings; verl 0.9.1 fails inside validate_config (ConfigAttributeError: "
        "Key 'megatron' is not in struct)",
        f"model_engine=megatron (it sets {ARR}.actor.strategy itself; drop {ARR}.actor.strategy=megatron)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule}-{i}" for i, c in enumerate(CASES)])
def test_rule(case: Case) -> None:
    found = [f for f in run(*case.overrides) if f.rule_id == case.rule and f.severity is case.severity]
    assert [(f.message, f.fix) for f in found] == [(case.message, case.fix)]
    assert found[0].sources, "every finding names where its values came from"


def test_every_rule_has_a_row() -> None:
    table = {c.rule for c in CASES} | {"shadowed-value", "script-passthrough"}
    assert {r.rule_id for r in AUDIT_RULES} == table


def test_shadowed_user_file(tmp_path: Path) -> None:
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("data:\n  train_batch_size: 64\n")
    found = [
        f for f in run("data.train_batch_size=128", NAME, files=(run_yaml,)) if f.rule_id == "shadowed-value"
    ]
    assert [(f.severity, f.message, f.fix) for f in found] == [
        (
            Severity.INFO,
            f"data.train_batch_size: 128 from argument 1 replaces 64 from {run_yaml}:2",
            "nothing to do if intended; drop argument 1 to keep the file's 64",
        )
    ], "a command-line value over a -c file's is an intended override: fixes stack on the file"


def test_a_later_file_silently_beating_an_earlier_one_is_a_warning(tmp_path: Path) -> None:
    first, second = tmp_path / "base.yaml", tmp_path / "exp.yaml"
    first.write_text("data:\n  train_batch_size: 64\n")
    second.write_text("data:\n  train_batch_size: 32\n")
    found = [f for f in run(NAME, files=(first, second)) if f.rule_id == "shadowed-value"]
    assert [(f.severity, f.message) for f in found] == [
        (
            Severity.WARNING,
            f"data.train_batch_size is 64 in {first}:2 but 32 on {second}:2; the user file wins, so the run uses 32",
        )
    ]


def test_shadowed_preset_value_is_info() -> None:
    preset = yaml.safe_load((preset_dir() / "small.yaml").read_text())
    old = preset["data"]["train_batch_size"]
    c = compose(
        ComposeRequest(overrides=cli_tokens([NAME, f"data.train_batch_size={old * 2}"]), preset="small")
    )
    found = [f for f in audit(c) if f.rule_id == "shadowed-value"]
    assert [(f.severity, f.message) for f in found] == [
        (
            Severity.INFO,
            f"data.train_batch_size: {old * 2} from argument 2 replaces {old} from preset small "
            "(conf/preset/small.yaml:11)",
        )
    ]


def test_passthrough_override_of_a_script_value_is_info_not_error() -> None:
    launch = read_script(SCRIPTS / "grpo_gsm8k.sh")[0]
    passthrough = cli_tokens(["trainer.nnodes=2", f"{ARR}.rollout.n=8"], [4, 5])
    findings = audit(OVERLAY.compose(launch.request(passthrough))) + script_findings(launch)
    assert not [f for f in findings if f.severity is Severity.ERROR]
    replaced = [f.message for f in findings if f.rule_id == "script-passthrough" and f.keys != ("$@",)]
    assert replaced == [
        f"{ARR}.rollout.n=8 passed to the script (argument 5) replaces the script's 5 "
        f'({SCRIPTS / "grpo_gsm8k.sh"}:35), as "$@" intends',
        f"trainer.nnodes=2 passed to the script (argument 4) replaces the script's 1 "
        f'({SCRIPTS / "grpo_gsm8k.sh"}:45), as "$@" intends',
    ]


def test_script_findings_name_both_lines_of_a_flipped_key() -> None:
    launch = read_script(SCRIPTS / "grpo_kl_flip.sh")[0]
    findings = audit(OVERLAY.compose(launch.request()))
    assert not [f for f in findings if f.severity is Severity.ERROR]  # verl runs it, with the last value
    warnings = [f for f in findings if f.severity is Severity.WARNING]
    assert [f.rule_id for f in warnings] == ["duplicate-key"]
    assert [s.line for _, _, s in warnings[0].sources] == [14, 24]


# --- no false alarms on verl's own defaults ---------------------------------------------------------------


@pytest.mark.parametrize("engine", ["dp", "megatron"])
def test_verl_defaults_raise_nothing(engine: str) -> None:
    assert run(f"model_engine={engine}", NAME) == []


# --- the tables against the installed verl ----------------------------------------------------------------


def test_alias_and_ignored_keys_exist_in_verl() -> None:
    facts = key_facts(composed(NAME).writes)
    for alias in ALIASES:
        assert facts.known(alias.old) or alias.old.startswith("trainer."), alias.old
        assert facts.known(alias.new), alias.new
    for entry in IGNORED:
        prefix = entry.pattern.removesuffix(".*")
        assert facts.known(entry.pattern) or any(k.startswith(prefix + ".") for k in facts.defaults), (
            entry.pattern
        )


@pytest.mark.parametrize("engine", ["dp", "megatron"])
def test_every_key_verl_marks_deprecated_is_reported(engine: str) -> None:
    marked = yaml_deprecations(composed(f"model_engine={engine}", NAME).writes)
    assert len(marked) >= 10
    uncovered = sorted(k for k in marked if not covered(k))
    assert all(k.endswith((".steps", ".vanilla_mbridge")) for k in uncovered), uncovered
    from verl_safe_launch.preflight import run_preflight

    reporters = ("deprecated-alias", "deprecated-key", *(f"verl-{r}-micro-keys" for r in ("actor", "critic")))
    reporters += ("verl-rollout-logprob-micro-keys", "verl-ref-logprob-micro-keys")
    for key in marked:
        found = run_preflight(composed(f"model_engine={engine}", NAME, f"++{key}=7")).findings
        assert any(key in f.keys for f in found if f.rule_id in reporters), key


# --- golden: the audit of a fixture script ----------------------------------------------------------------


def test_golden_audit_of_the_ppo_critic_script() -> None:
    launch = read_script(SCRIPTS / "ppo_critic.sh")[0]
    text = render_findings_text(audit(OVERLAY.compose(launch.request())) + script_findings(launch))
    text = text.replace(str(SCRIPTS), "tests/data/scripts")
    check_golden("audit_ppo_critic.txt", text)


@pytest.mark.parametrize(
    "overrides",
    [
        (f"{ARR}.actor.ppo_micro_batch_size=64", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=8"),
        (f"{ARR}.rollout.log_prob_micro_batch_size=64",),
        ("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=32"),
    ],
)
def test_a_deprecated_micro_key_is_one_finding(overrides: tuple[str, ...]) -> None:
    from verl_safe_launch.preflight import run_preflight

    findings = run_preflight(composed(*overrides, NAME)).findings
    errors = [
        f
        for f in findings
        if f.severity is Severity.ERROR and f"{overrides[-1].split('=')[0]}" in " ".join(f.keys)
    ]
    assert len(errors) == 1, [(f.rule_id, f.message) for f in errors]
    assert errors[0].rule_id.startswith("verl-") and errors[0].rule_id.endswith("-micro-keys")

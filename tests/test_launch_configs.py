"""What a launch composes and runs: its --config-name/--config-path, a launch held in a string, ``key=$X``.

Real parts: the installed verl's own config directory and real bash (``--trace``) as the oracle of what runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.compose import compose
from verl_safe_launch.shell import parse_script, read_script, trace_script, traced_launches

LAUNCH = "python3 -m verl.trainer.main_ppo"
BASE = (
    "data.train_batch_size=64 trainer.n_gpus_per_node=8 actor_rollout_ref.rollout.name=vllm "
    "actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 algorithm.adv_estimator=grpo "
    "actor_rollout_ref.rollout.n=4"
)


def _errors(report: dict[str, object]) -> list[tuple[str, tuple[str, ...]]]:
    scripts = report["scripts"]
    assert isinstance(scripts, list)
    return [
        (f["rule_id"], tuple(f["keys"]))
        for launch in scripts[0]["launches"]
        for f in launch["findings"]
        if f["severity"] == "error"
    ]


def _audit(cli: Callable[..., CliResult], path: Path) -> dict[str, object]:
    result = cli("audit", str(path), "--format", "json")
    assert result.code in (0, 1), result.err
    data: dict[str, object] = json.loads(result.out)
    return data


def test_show_and_check_take_a_config_name(cli: Callable[..., CliResult]) -> None:
    """``--config-name ppo_megatron_trainer``: composed by that name, as verl's own Hydra would."""
    shown = cli("show", "--config-name", "ppo_megatron_trainer", "--key", "model_engine")
    assert shown.code == 0 and shown.out.startswith("model_engine = megatron")
    checked = cli("check", "--config-name", "ppo_megatron_trainer", *BASE.split(), "--format", "json")
    strategy = json.loads(cli("show", "--config-name", "ppo_megatron_trainer", "--format", "json").out)
    assert strategy["config"]["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    assert json.loads(checked.out)["verdict"] in ("go", "no-go")
    missing = cli("check", "--config-name", "ppo_nothing")
    assert (missing.code, missing.err.splitlines()[0]) == (
        2,
        "error: verl 0.9.1 has no config 'ppo_nothing', so Hydra stops before verl starts",
    )


def test_a_user_config_under_the_working_directory_is_read_from_the_scripts_project(tmp_path: Path) -> None:
    """``--config-path "$(pwd)/conf"`` in a script run from its project's root: the file there is composed."""
    project = tmp_path / "proj"
    (project / "conf").mkdir(parents=True)
    (project / ".git").mkdir()
    (project / "conf" / "mine.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  max_prompt_length: 333\n"
    )
    script = project / "scripts" / "run.sh"
    script.parent.mkdir()
    script.write_text(f'ROOT="$(pwd)"\n{LAUNCH} --config-path="$ROOT/conf" --config-name=mine {BASE}\n')
    [launch] = read_script(script)
    assert launch.config_files == ((project / "conf" / "mine.yaml").resolve(),)
    assert compose(launch.request()).view.get("data.max_prompt_length") == 333
    [note] = [n for n in launch.notes if n.kind == "config-path"]
    assert note.detail == f"the working directory read as {project.resolve()}, where conf is"


def test_a_config_no_file_could_hold_is_an_error(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"{LAUNCH} --config-path={tmp_path}/nothere --config-name=mine {BASE}\n")
    report = _audit(cli, script)
    assert report["verdict"] == "no-go"
    assert [rule for rule, _ in _errors(report)] == ["script-config"]


LAUNCHES_IN_STRINGS = [
    pytest.param(f'CMD="{LAUNCH} {BASE}"\n$CMD\n', id="unquoted-variable"),
    pytest.param(f'CMD="{LAUNCH} \\\n  {BASE}"\neval "$CMD"\n', id="eval"),
    pytest.param(f"COMMAND='{LAUNCH} {BASE}'\nbash -c \"$COMMAND\"\n", id="bash-c"),
]


@pytest.mark.parametrize("text", LAUNCHES_IN_STRINGS)
def test_a_launch_held_in_a_string_is_read_as_bash_runs_it(tmp_path: Path, text: str) -> None:
    """The oracle is real bash with recorders: the same overrides reach verl."""
    script = tmp_path / "run.sh"
    script.write_text(f"{text}echo $CMD $COMMAND  # printed, not run\n")
    static = read_script(script)
    traced = traced_launches(str(script), trace_script(script, {}).calls)
    assert len(static) == len(traced) == 1
    assert [t.text for t in static[0].tokens] == [t.text for t in traced[0].tokens] == BASE.split()


def test_an_override_whose_value_is_not_read_still_has_its_key_checked(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f'{LAUNCH} {BASE} "trainer.bogus_key=$X" data.max_prompt_length=$LEN\n')
    report = _audit(cli, script)
    assert _errors(report) == [("unknown-key", ("trainer.bogus_key",))]
    scripts = report["scripts"]
    assert isinstance(scripts, list)
    [finding] = [f for f in scripts[0]["launches"][0]["findings"] if f["rule_id"] == "unknown-key"]
    assert finding["message"] == (
        "unknown key trainer.bogus_key: verl 0.9.1's config has no such key, so Hydra refuses "
        "'trainer.bogus_key=$X', whatever the value"
    )
    script.write_text(f'{LAUNCH} {BASE} data.max_prompt_length=$LEN "trainer.project_name=$X"\n')
    assert _errors(_audit(cli, script)) == []


def test_a_mandatory_key_of_a_section_switched_off_is_not_required() -> None:
    """``???`` under ``reward.reward_model`` is read only with the reward model on."""
    text = f"{LAUNCH} {BASE} reward.reward_model.rollout.name=???\n"
    [launch] = parse_script(text, "run.sh")
    from verl_safe_launch.audit import audit

    composed = compose(launch.request())
    assert not [f for f in audit(composed) if f.rule_id == "missing-required"]
    [on] = parse_script(text.replace("\n", " reward.reward_model.enable=true\n"), "run.sh")
    assert [f.keys for f in audit(compose(on.request())) if f.rule_id == "missing-required"] == [
        ("reward.reward_model.rollout.name",)
    ]


def test_a_reward_models_rollout_is_not_required_under_the_legacy_reward_worker() -> None:
    """Releases 0.7.0 to the 0.8 development line have ``reward_model.use_reward_loop``; switched off, the trainer
    scores with the legacy reward-model worker and never reads the rollout section (verl 0.9.1 has no such switch,
    so the key is added here with ``+`` to exercise the gate on the installed config)."""
    from verl_safe_launch.audit import audit

    text = f"{LAUNCH} {BASE} reward.reward_model.rollout.name=??? reward.reward_model.enable=true"
    for switch, required in (("false", []), ("true", [("reward.reward_model.rollout.name",)])):
        [launch] = parse_script(f"{text} +reward.reward_model.use_reward_loop={switch}\n", "run.sh")
        found = [f.keys for f in audit(compose(launch.request())) if f.rule_id == "missing-required"]
        assert found == required, switch

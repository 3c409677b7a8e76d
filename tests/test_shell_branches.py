"""Branches of a script: conditions the script decides pick their branch; the others are read as possible worlds."""

from __future__ import annotations

import subprocess

import pytest

from verl_safe_launch.preflight import Auditor
from verl_safe_launch.shell import ScriptLaunch, parse_script

LAUNCH = "python3 -m verl.trainer.main_ppo"


def one(text: str) -> ScriptLaunch:
    launches = parse_script(text, "run.sh")
    assert len(launches) == 1, launches
    return launches[0]


def texts(launch: ScriptLaunch) -> list[str]:
    return [t.text for t in launch.tokens]


def bash_args(text: str) -> list[str]:
    """What real bash passes to the launch (the launcher replaced by printf)."""
    script = text.replace(LAUNCH, "printf '%s\\n'")
    done = subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, check=True, env={})
    return done.stdout.splitlines()


DECIDED = [
    'backend=fsdp\nif [ "$backend" = "fsdp" ]; then\n  A="x.a=1 x.b=2"\nelse\n  A="x.c=3"\nfi\n',
    'backend=megatron\nif [[ $backend == fsdp ]]; then\n  A="x.a=1"\nelif [[ $backend == meg* ]]; then\n'
    '  A="x.b=2"\nelse\n  A="x.c=3"\nfi\n',
    'N=4\nif [ $N -gt 1 ] && [ -n "$N" ]; then A=x.big=1; else A=x.small=1; fi\n',
    'MODE=a\nif [ "$MODE" != "a" ]; then\n  A=x.other=1\nfi\nA="${A:-x.default=1}"\n',
    'N=1\nif test "$N" -eq 2; then A=x.two=1; elif ! [ "$N" = 3 ]; then A=x.not_three=1; fi\n',
]


@pytest.mark.parametrize("head", DECIDED)
def test_a_condition_the_script_decides_picks_the_branch_bash_takes(head: str) -> None:
    text = f"{head}{LAUNCH} $A trainer.nnodes=1\n"
    launch = one(text)
    assert texts(launch) == bash_args(text)
    assert not [n for n in launch.notes if n.unread]
    assert launch.worlds == ()


def test_a_condition_decided_by_a_default_says_the_environment_could_change_it() -> None:
    """``${CP:-1}``: bash takes the branch of the default when the environment does not set CP, and the report
    says the default decided it, as it does for a value (the same ``env-default`` note)."""
    text = f'if [ "${{CP:-1}}" -gt 1 ]; then A=x.cp=2; else A=x.cp=1; fi\n{LAUNCH} $A\n'
    launch = one(text)
    assert texts(launch) == bash_args(text) == ["x.cp=1"]
    notes = [n for n in launch.notes if n.kind == "env-default"]
    assert [(n.line, n.raw) for n in notes] == [(1, '"${CP:-1}"')]
    assert "CP is not set in the script, so its default '1' is used" in notes[0].detail


def test_a_case_decided_by_a_default_says_so_too() -> None:
    text = f'case "${{ENGINE:-fsdp}}" in\n  megatron) A=x.e=m ;;\n  *) A=x.e=f ;;\nesac\n{LAUNCH} $A\n'
    launch = one(text)
    assert texts(launch) == bash_args(text) == ["x.e=f"]
    notes = [n for n in launch.notes if n.kind == "env-default"]
    assert [(n.line, n.raw) for n in notes] == [(1, '"${ENGINE:-fsdp}"')]


def test_branches_on_an_outside_value_are_possible_worlds() -> None:
    text = (
        'if [ "$NNODES" -gt 1 ]; then\n  RAY=(trainer.nnodes=2)\nelse\n  RAY=(trainer.nnodes=1)\nfi\n'
        f'{LAUNCH} "${{RAY[@]}}" data.train_batch_size=8\n'
    )
    launch = one(text)
    assert [n.kind for n in launch.notes if n.unread] == ["unresolved"]  # one pass: RAY is unknown
    worlds = {tuple(texts(w)) for w in launch.worlds}
    assert worlds == {
        ("trainer.nnodes=2", "data.train_batch_size=8"),
        ("trainer.nnodes=1", "data.train_batch_size=8"),
    }
    assert all(not [n for n in w.notes if n.unread] for w in launch.worlds)
    assert {w.branch for w in launch.worlds} == {
        "the if on line 1 takes branch 1",
        "the if on line 1 takes branch 2",
    }


def test_a_case_on_an_outside_value_without_catch_all_has_a_world_where_no_branch_runs() -> None:
    text = f"A=x.none=1\ncase $E in\n  a) A=x.a=1 ;;\n  b) A=x.b=1 ;;\nesac\n{LAUNCH} $A\n"
    worlds = sorted(tuple(texts(w)) for w in one(text).worlds)
    assert worlds == [("x.a=1",), ("x.b=1",), ("x.none=1",)]


def test_args_slices_are_the_scripts_arguments() -> None:
    for form in ('"${@:1}"', '"${@:2}"'):
        launch = one(f"{LAUNCH} trainer.nnodes=1 {form}\n")
        assert launch.passthrough is not None and launch.passthrough.position == 1
        assert not [n for n in launch.notes if n.unread]


ERROR_IN_EVERY_WORLD = """\
if [ "$NNODES" -gt 1 ]; then
    RAY=(trainer.nnodes=2 trainer.n_gpus_per_node=8)
else
    RAY=(trainer.nnodes=1 trainer.n_gpus_per_node=8)
fi
python3 -m verl.trainer.main_ppo "${RAY[@]}" data.train_batch_size=8 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
"""


MICRO = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"
    " actor_rollout_ref.rollout.name=vllm algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=4"
)


def test_an_error_in_every_world_is_no_go_and_one_in_some_worlds_cannot_be_verified(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "run.sh"
    path.write_text(ERROR_IN_EVERY_WORLD)
    item = Auditor().script(path).launches[0]
    assert item.verdict == "no-go"
    one_world = (
        ERROR_IN_EVERY_WORLD.replace("data.train_batch_size=8", "data.train_batch_size=64")
        .replace(
            "=(trainer.nnodes=1 trainer.n_gpus_per_node=8)", "=(trainer.nnodes=1 trainer.n_gpu_per_node=8)"
        )
        .replace("ppo_mini_batch_size=16", f"ppo_mini_batch_size=16 {MICRO}")
    )
    path.write_text(one_world)
    item = Auditor().script(path).launches[0]
    assert item.verdict == "unverified"
    only = [f for f in item.findings if f.rule_id == "cannot-verify" and "takes branch 2" in f.message]
    assert only and "n_gpu_per_node" in only[0].message


REFUSED = """\
python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.name=vllm \\
  actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \\
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \\
  {override} $EXTRA
"""


@pytest.mark.parametrize(
    ("override", "verdict"),
    [
        ("+actor_rollout_ref.actor.policy_loss.tau_pos=1.0", "no-go"),  # PolicyLossConfig under every engine
        ("+data.max_prompt_length=256", "no-go"),  # '+' on a key every config has
        (
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "unverified",
        ),  # $EXTRA may pick megatron
    ],
)
def test_a_refused_override_stays_refused_whatever_an_unread_word_is(
    tmp_path: object, override: str, verdict: str
) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "run.sh"
    path.write_text(REFUSED.format(override=override))
    item = Auditor().script(path).launches[0]
    assert item.verdict == verdict, [(f.rule_id, f.message) for f in item.findings]

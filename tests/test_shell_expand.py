"""Expansion with a script's own variables against bash itself; what bash needs the run time for stays unresolved."""

from __future__ import annotations

import subprocess

import pytest

from verl_safe_launch.shell.expand import (
    OPAQUE,
    ArrayValue,
    Env,
    Expander,
    Scalar,
    Unknown,
    apply_assignments,
)
from verl_safe_launch.shell.words import ArrayAssign, Op, Word, lex


def bash_args(setup: str, command: str) -> list[str]:
    """The arguments bash passes to a command after running ``setup`` (clean environment, no rc files)."""
    script = f"{setup}\nprintf '<%s>\\n' {command}"
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        check=True,
    )
    out = done.stdout
    assert out.startswith("<") and out.endswith(">\n"), out
    return out[1:-2].split(">\n<")


def assign(setup: str, *, conditional: bool = False) -> tuple[Env, list[str]]:
    """Our variables after ``setup`` (assignments only), and the default notes."""
    env: Env = {}
    items = [t for t in lex(setup) if not isinstance(t, Op)]
    assert all(isinstance(t, ArrayAssign) or "=" in t.raw for t in items)
    notes = apply_assignments(env, items, conditional=conditional)  # type: ignore[arg-type]
    return env, [n.detail for n in notes]


def expand(setup: str, command: str) -> list[str]:
    env, _ = assign(setup)
    expander = Expander(env)
    fields = [f for t in lex(command) if isinstance(t, Word) for f in expander.word(t)]
    assert all(f.problem is None for f in fields), [f.problem for f in fields]
    return [f.text for f in fields]


CASES = [
    ("A=1", "x=$A y=${A}"),
    ("A='two words'", '$A "$A" x$A"y"'),
    ("A='  lead and trail  '", '[$A] "[$A]"'),
    ("A=''", '$A "$A" x$A'),
    ('A=a B=b\nC="$A-$B"', "$C ${C}x"),
    ("A=base\nA+=' more'", '"$A" $A'),
    ("A=val\nARGS=(one 'two three')\nARGS+=(four \"$A\" '' \"x  y\")", '"${ARGS[@]}"'),
    ("ARGS=(one 'two three' '' ' x  y ')", "${ARGS[@]} $ARGS"),
    ("A=set", '${A:-fallback} "${UNSET:-fall back}" ${EMPTY:-x}'),
    ("EMPTY=", "${EMPTY:-used} ${EMPTY-kept}end"),
    ("P=actor_rollout_ref.actor", "${P}.ppo_micro_batch_size_per_gpu=4 $P.x='a b'"),
    # Inside double quotes, single quotes in a default are characters (verl-tool's action_stop_tokens list).
    ("X=\"${X:-['</tool_call>']}\"", 'k=${X} "k=$X"'),
    (
        "",
        '"${U:-\'a b\'}" "${U:-"q"}" "${U:-x\\\'y}" "${U:-$\'t\'}" "${U:-a  <b> | c;d}"',
    ),  # Unquoted, bash splits only the default's unquoted parts.
    ("", "${U:-'a b'} x${U:-\"c  d\"e f}y ${EMPTY:-'p q'}"),
]


@pytest.mark.parametrize(("setup", "command"), CASES)
def test_expansion_matches_bash(setup: str, command: str) -> None:
    assert expand(setup, command) == bash_args(setup, command)


def test_values_and_default_notes() -> None:
    env, notes = assign("A=1\nB=(x 'y z')\nC=${UNSET:-d}\nD=$(date)")
    assert env["A"] == Scalar("1") and env["C"] == Scalar("d")
    assert isinstance(env["B"], ArrayValue) and [f.text for f in env["B"].items] == ["x", "y z"]
    assert env["D"] == Scalar(OPAQUE, "the command substitution $(date) (line 4)")  # unknown, but present
    assert notes == ["UNSET is not set in the script, so its default 'd' is used"]


def test_assignment_inside_a_block_is_unknown() -> None:
    env, _ = assign("A=1", conditional=True)
    assert env["A"] == Unknown("$A, which is assigned inside an if/case/loop block (line 1)")


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("x=$NOPE", "$NOPE, which the script does not set"),
        ("x=$1", "$1, an argument of the script"),
        ("x=$$", "$$, which the shell sets at run time"),
        ("x=$(hostname)", "the command substitution $(hostname) (line 1)"),
        ("x=`hostname`", "the command substitution `hostname` (line 1)"),
        ("x=$@", "the script's arguments ($@) inside a longer word (line 1)"),
        ("x=$D", "the command substitution $(date) (line 1)"),
    ],
)
def test_what_only_the_run_time_knows_is_a_problem_not_a_guess(command: str, problem: str) -> None:
    env, _ = assign("D=$(date)")
    [word] = [t for t in lex(command) if isinstance(t, Word)]
    [field] = Expander(env).word(word)
    assert (field.problem, field.text) == (problem, "x=" + OPAQUE)  # the known part kept, the rest opaque


def test_an_array_the_script_never_sets_expands_to_no_words_as_in_bash() -> None:
    [word] = [t for t in lex('"${NOARR[@]}"') if isinstance(t, Word)]
    assert Expander({}).word(word) == []


def test_passthrough_arguments_are_marked() -> None:
    [word] = [t for t in lex('"$@"') if isinstance(t, Word)]
    [field] = Expander({}).word(word)
    assert (field.args, field.problem, field.text) == (True, None, '"$@"')

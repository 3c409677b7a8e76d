"""Real bash is the oracle of the static reader: what the reader claims to have read is what bash passes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DATA, CliResult

from verl_safe_launch.shell import ScriptLaunch, read_script, trace_script, traced_launches

SCRIPTS = sorted((DATA / "scripts").glob("*.sh")) + sorted((DATA / "scripts" / "corpus").glob("*.sh"))
ENV = {"HOME": "/home/vsl", "USER": "vsl"}


def texts(launch: ScriptLaunch) -> list[str]:
    return [t.text for t in launch.tokens]


def expected(launch: ScriptLaunch) -> list[str]:
    """The statically read overrides as bash writes them with ``ENV`` (``$PWD`` is the trace's own directory)."""
    out = []
    for text in texts(launch):
        for name, value in ENV.items():
            text = text.replace(f"${name}", value)
        out.append(text)
    return out


def is_subsequence(part: list[str], whole: list[str]) -> bool:
    it = iter(whole)
    return all(any(word == other for other in it) for word in part)


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_static_reader_agrees_with_bash(path: Path) -> None:
    static = read_script(path)
    traced = traced_launches(str(path), trace_script(path, ENV).calls, static)
    assert len(traced) == len(static)
    for mine, real in zip(static, traced, strict=True):
        claimed = [t for t in expected(mine) if "$PWD" not in t]
        bash = texts(real)
        if any(n.unread for n in mine.notes) or len(claimed) != len(expected(mine)):
            assert is_subsequence(claimed, bash), (claimed, bash)
        else:
            assert claimed == bash


def test_trace_records_every_launcher(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        'N=$((4/2))\nexport X="${X:-1}"\ntorchrun --nproc 2 -m verl.trainer.main_ppo a.b=$N\n'
        "uv run python -m verl.trainer.main_ppo c.d=$X\nray job submit -- python3 -m verl.trainer.main_ppo e=1\n"
    )
    trace = trace_script(script, {"X": "7"})
    assert [call[0] for call in trace.calls] == ["torchrun", "uv", "ray"]
    assert [texts(x) for x in traced_launches(str(script), trace.calls)] == [["a.b=2"], ["c.d=7"], ["e=1"]]


def test_trace_runs_in_an_empty_environment(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text('python3 -m verl.trainer.main_ppo "a.b=${HOME:-none}" "c.d=$(pwd)"\n')
    (launch,) = traced_launches(str(script), trace_script(script).calls)
    assert texts(launch)[0] == "a.b=none"
    assert texts(launch)[1] != f"c.d={Path.cwd()}"


def test_audit_trace_audits_what_bash_ran(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        "A=(algorithm.adv_estimator=grpo)\ncase $ENGINE in\n  megatron) A+=(model_engine=megatron) ;;\n"
        '  *) A+=(actor_rollout_ref.rollout.nam=vllm) ;;\nesac\npython3 -m verl.trainer.main_ppo "${A[@]}"\n'
    )
    static = cli("audit", str(script))
    assert "cannot verify [unknown-key]" in static.out  # only on one path: the case on $ENGINE decides
    assert "the case on line 2 takes branch 2" in static.out
    traced = cli("audit", "--trace", str(script))
    assert traced.code == 1
    assert "unknown key actor_rollout_ref.rollout.nam" in traced.out
    assert cli("audit", "--trace", "--env", "nope", str(script)).code == 2


def test_trace_timeout_is_a_compact_error(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("while true; do :; done\npython3 -m verl.trainer.main_ppo a=1\n")
    result = cli("audit", "--trace", "--timeout", "1", str(script))
    assert result.code == 2
    assert "did not finish within 1 s under --trace" in result.out + result.err


def test_audit_trace_passes_the_arguments_to_the_script(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    script = tmp_path / "run.sh"
    script.write_text('python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "$@"\n')
    result = cli("audit", "--trace", "--format", "json", str(script), "--", "trainer.nnodes=0")
    launch = json.loads(result.out)["scripts"][0]["launches"][0]
    assert {"text": "trainer.nnodes=0", "line": 1} in launch["overrides"]
    assert "script-passthrough" not in [f["rule_id"] for f in launch["findings"] if f["severity"] != "info"]


def test_ansi_c_strings_and_quoted_exports_read_as_bash_runs_them(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        "X=$'\\'a\\''\nexport 'Y=b c'\nexport \"Z=$X-1\" PLAIN\ndeclare -x 'W=$HOME'\n"
        'python3 -m verl.trainer.main_ppo "trainer.project_name=$X" trainer.experiment_name="$Y" '
        '"data.seed=$Z" $\'trainer.a=\\x41\\101\\u00e9\\tb\\\\\' "trainer.b=$\'x\'" "trainer.c=$W"\n'
    )
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    (static,) = read_script(script)
    assert not static.notes
    (traced,) = traced_launches(str(script), trace_script(script).calls)
    assert texts(static) == texts(traced)
    assert texts(static)[:3] == ["trainer.project_name='a'", "trainer.experiment_name=b c", "data.seed='a'-1"]
    assert {e.name: e.value for e in static.exports} == {"Y": "b c", "Z": "'a'-1", "W": "$HOME"}


def test_audit_trace_keeps_the_scripts_arguments_apart(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text('python3 -m verl.trainer.main_ppo trainer.nnodes=1 "$@"\n')
    result = cli("audit", "--trace", "--format", "json", str(script), "--", "trainer.nnodes=2")
    findings = json.loads(result.out)["scripts"][0]["launches"][0]["findings"]
    rules = {f["rule_id"]: f["severity"] for f in findings if "trainer.nnodes" in f["keys"]}
    assert rules.get("script-passthrough") == "info" and "duplicate-key" not in rules, rules

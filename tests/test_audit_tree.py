"""``audit PATH...`` as a CI gate: folders walked (.gitignore, --exclude, symlinks), skipped scripts, the closing
table and exit codes, SARIF checked against the official 2.1.0 schema, JUnit, a baseline, and the command that
settles an UNVERIFIED launch run for real."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from conftest import CliResult

from verl_safe_launch.preflight import find_scripts

Cli = Callable[..., CliResult]
DATA = Path(__file__).resolve().parent / "data"
SCRIPTS = DATA / "scripts"
SCHEMA = json.loads((DATA / "sarif" / "sarif-schema-2.1.0.json").read_text())

LAUNCH = """\
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_batch_size=64 \\
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \\
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \\
    trainer.n_gpus_per_node=8 {extra}
"""
GROUP = "actor_rollout_ref.rollout.n=4"  # GRPO compares a group of responses per prompt
# the node count pasted twice: Hydra keeps 3, and 64 prompts × 4 do not split over 24 GPUs (validate_config stops)
NO_GO = "#!/bin/bash\n" + LAUNCH.format(extra=f"{GROUP} trainer.nnodes=1 trainer.nnodes=3")
GO = "#!/bin/bash\n" + LAUNCH.format(extra=f"{GROUP} trainer.nnodes=1")
SFT = "#!/bin/bash\ntorchrun --nproc_per_node=8 -m verl.trainer.fsdp_sft_trainer data.train_batch_size=8\n"
PREP = "#!/bin/bash\npython3 examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k\n"
JOB = (DATA / "sbatch" / "single_node.sbatch").read_text()


def _tree(root: Path) -> Path:
    """A repository of real-looking scripts: PPO launches, an SFT and a data script, a Slurm job, symlinks."""
    files = {
        "recipes/grpo.sh": GO,
        "recipes/broken_batch.sh": NO_GO,
        "recipes/sft.sh": SFT,
        "data/prepare.sh": PREP,
        "slurm/job.sbatch": JOB,
        "build/generated.sh": NO_GO,
        "legacy/old.sh": NO_GO,
        "tools/notes.md": "not a script\n",
        "tools/runner": "#!/usr/bin/env bash\n" + GO.split("\n", 1)[1],
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / ".gitignore").write_text("build/\n*.log\n")
    (root / "recipes" / "same_as_grpo.sh").symlink_to("grpo.sh")
    (root / "recipes" / "loop").symlink_to("..")
    (root / "recipes" / "outside.sh").symlink_to(SCRIPTS / "grpo_gsm8k.sh")
    (root / "recipes" / "dangling.sh").symlink_to("nowhere.sh")
    return root


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return _tree(tmp_path / "repo")


def test_walk_honours_gitignore_exclude_and_symlinks(repo: Path) -> None:
    found = {
        Path(f.path).relative_to(repo).as_posix(): f.skip for f in find_scripts([str(repo)], ["legacy/*"])
    }
    assert set(found) == {
        "data/prepare.sh",
        "recipes/broken_batch.sh",
        "recipes/dangling.sh",
        "recipes/grpo.sh",
        "recipes/outside.sh",
        "recipes/sft.sh",
        "slurm/job.sbatch",
        "tools/runner",
    }, "build/ is ignored, legacy/ excluded, the loop and the duplicate link not followed"
    assert found["recipes/outside.sh"] is not None and "outside" in found["recipes/outside.sh"]
    assert found["recipes/dangling.sh"] is not None and "does not exist" in found["recipes/dangling.sh"]
    assert found["recipes/grpo.sh"] is None


@pytest.mark.skipif(shutil.which("git") is None, reason="git is the oracle of .gitignore")
def test_gitignore_matching_agrees_with_git(tmp_path: Path) -> None:
    """Real git decides which untracked files its .gitignore rules leave out; the walk must agree."""
    root = tmp_path / "g"
    for name in ("a.sh", "b/c.sh", "b/d/e.sh", "x/y.sh", "x/keep.sh", "deep/x/z.sh", "n.sh", "lib/one.sh"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("#!/bin/bash\necho\n")
    (root / ".gitignore").write_text("/x/*\n!/x/keep.sh\n**/d/\nn.sh\n# a comment\nlib\n")
    (root / "b" / ".gitignore").write_text("c.sh\n")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_SYSTEM": os.devnull}
    subprocess.run(["git", "init", "-q", str(root)], check=True, env=env)
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.split()
    expected = {p for p in listed if p.endswith(".sh")}
    walked = {Path(f.path).relative_to(root).as_posix() for f in find_scripts([str(root)]) if f.skip is None}
    assert walked == expected == {"a.sh", "deep/x/z.sh", "x/keep.sh"}


def test_folder_audit_table_totals_and_exit_code(repo: Path, cli: Cli) -> None:
    result = cli("audit", str(repo), "--exclude", "legacy/*")
    assert result.code == 1, result.out
    table = result.out[result.out.rindex("\nscript ") + 1 :].splitlines()
    assert table[0].split() == ["script", "verdict", "errors", "warnings", "first", "error"]
    rows = {line.split()[0]: line.split() for line in table[1:-1]}
    assert rows[f"{repo}/recipes/broken_batch.sh"][1:4] == ["NO-GO", "2", "3"]
    assert rows[f"{repo}/recipes/broken_batch.sh"][4] == "batch-train-divisible-gpus"
    assert rows[f"{repo}/recipes/grpo.sh"][1] == "GO"
    assert rows[f"{repo}/recipes/sft.sh"][1] == "skipped"
    assert "verl.trainer.fsdp_sft_trainer (SFT)" in " ".join(rows[f"{repo}/recipes/sft.sh"])
    assert "(data preparation)" in " ".join(rows[f"{repo}/data/prepare.sh"])
    assert rows[f"{repo}/slurm/job.sbatch"][1] == "GO"
    assert table[-1].startswith(
        "8 scripts (1 NO-GO, 0 UNVERIFIED, 3 GO, 4 skipped, 0 unreadable); 4 launches"
    )
    assert f"{repo}/build/generated.sh" not in result.out


def test_exit_codes_go_warning_and_unusable(tmp_path: Path, cli: Cli) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "go.sh").write_text(GO)
    (tmp_path / "ok" / "sft.sh").write_text(SFT)
    assert cli("audit", str(tmp_path / "ok")).code == 0
    assert cli("audit", str(tmp_path / "ok" / "sft.sh")).code == 0, (
        "a named SFT script is skipped, not an error"
    )
    assert (
        cli("audit", str(tmp_path / "ok"), "--fail-on", "warning").code == 1
    )  # verl's placeholder data paths
    assert cli("audit", str(tmp_path / "missing")).code == 2
    assert cli("audit", str(tmp_path / "ok"), "--fail-on", "nope").code == 2
    (tmp_path / "ok" / "broken.sh").write_text("python3 -m verl.trainer.main_ppo a='x\n")
    walked = cli("audit", str(tmp_path / "ok"))
    assert walked.code == 1, "a gate never passes a script it could not read"
    row = next(
        line for line in walked.out.splitlines() if line.startswith(str(tmp_path / "ok" / "broken.sh"))
    )
    assert row.split()[1] == "unreadable" and "unterminated single quote" in row
    assert cli("audit", str(tmp_path / "ok"), "--exclude", "broken.sh").code == 0
    assert cli("audit", str(tmp_path / "ok" / "broken.sh")).code == 2, (
        "a named one is an unusable command line"
    )
    document = json.loads(cli("audit", str(tmp_path / "ok"), "--format", "json").out)
    assert document["verdict"] == "input-error", "JSON never says go where a script was not judged"
    sarif = json.loads(cli("audit", str(tmp_path / "ok"), "--format", "sarif").out)
    jsonschema.validate(sarif, SCHEMA, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)
    (unreadable,) = [r for r in sarif["runs"][0]["results"] if r["ruleId"] == "script-unreadable"]
    assert unreadable["level"] == "error" and "unterminated single quote" in unreadable["message"]["text"]
    location = unreadable["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"].endswith("broken.sh") and location["region"]["startLine"] == 1
    assert sarif["runs"][0]["invocations"][0]["exitCode"] == 1
    junit = ET.fromstring(cli("audit", str(tmp_path / "ok"), "--format", "junit").out)
    errored = [s for s in junit.findall("testsuite") if (s.get("name") or "").endswith("broken.sh")]
    assert errored and errored[0].get("errors") == "1"


def test_sarif_is_valid_sarif_2_1_0_with_rules_results_and_fixes(repo: Path, cli: Cli) -> None:
    result = cli("audit", str(repo), "--format", "sarif")
    assert result.code == 1
    log = json.loads(result.out)
    jsonschema.validate(log, SCHEMA, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert all(r["help"]["text"] and r["helpUri"].startswith("https://") for r in rules)
    dup = [r for r in run["results"] if r["ruleId"] == "duplicate-key" and "broken_batch" in json.dumps(r)]
    assert dup, run["results"]
    first = dup[0]
    assert rules[first["ruleIndex"]]["id"] == "duplicate-key"
    location = first["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"].endswith("recipes/broken_batch.sh")
    assert location["region"]["startLine"] == 11
    assert "fix: keep one" in first["message"]["text"] and first["properties"]["fix"].startswith("keep one")
    notes = run["invocations"][0]["toolExecutionNotifications"]
    assert any("fsdp_sft_trainer" in n["message"]["text"] for n in notes)
    assert run["invocations"][0]["exitCode"] == 1


def test_junit_has_one_testcase_per_launch(repo: Path, cli: Cli) -> None:
    result = cli("audit", str(repo), "--format", "junit")
    suites = ET.fromstring(result.out).findall("testsuite")
    cases = {case.get("name"): case for suite in suites for case in suite.findall("testcase")}
    broken = next(case for name, case in cases.items() if name and "broken_batch.sh:" in name)
    failure = broken.find("failure")
    assert failure is not None and "[batch-train-divisible-gpus]" in (failure.get("message") or "")
    assert "[duplicate-key]" in (failure.text or ""), "the warnings are listed with the errors"
    sft = next(case for name, case in cases.items() if name and name.endswith("sft.sh"))
    assert sft.find("skipped") is not None
    launches = [c for n, c in cases.items() if n and (".sh:" in n or ".sbatch:" in n or "runner:" in n)]
    assert len(launches) == 5, list(cases)  # legacy/old.sh too: nothing is excluded here


def test_baseline_accepts_known_findings_and_reports_stale_ones(repo: Path, cli: Cli, tmp_path: Path) -> None:
    base = tmp_path / "baseline.json"
    wrote = cli("audit", str(repo), "--write-baseline", str(base))
    assert wrote.code == 0 and base.is_file()
    assert cli("audit", str(repo), "--write-baseline", str(base)).code == 2, "never replaced without --force"
    assert cli("audit", str(repo), "--baseline", str(base)).code == 0
    broken = repo / "recipes" / "broken_batch.sh"
    broken.write_text(
        "# moved down a line by an unrelated edit\n"
        + NO_GO.replace("Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct")
    )
    assert cli("audit", str(repo), "--baseline", str(base)).code == 0, "lines moved, another key changed"
    broken.write_text(NO_GO.replace("data.train_batch_size=64", "data.train_batch_size=32"))
    again = cli("audit", str(repo), "--baseline", str(base))
    assert again.code == 1, "a new value is a new finding"
    assert (
        "stale baseline entry: [batch-train-divisible-gpus]" in again.out
        and "data.train_batch_size=64 no longer found" in again.out
    )


@pytest.mark.parametrize(
    ("shape", "body", "value"),
    [
        ("a word", "python3 -m verl.trainer.main_ppo {launch} {group} $EXTRA\n", "trainer.total_epochs=2"),
        ("a value", "python3 -m verl.trainer.main_ppo {launch} actor_rollout_ref.rollout.n=$N\n", "4"),
        (
            "a branch",
            'if [ "$MODE" = single ]; then E=""; else E=trainer.nnodes=2; fi\n'
            "python3 -m verl.trainer.main_ppo {launch} {group} $E\n",
            "single",
        ),
        (
            "a command substitution",
            "N=$(echo 4)\npython3 -m verl.trainer.main_ppo {launch} actor_rollout_ref.rollout.n=$N\n",
            "",
        ),
    ],
)
def test_the_printed_command_settles_an_unverified_launch(
    shape: str, body: str, value: str, tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the command UNVERIFIED prints, in a shell with the variables set: it reaches GO or NO-GO."""
    launch = " ".join(LAUNCH.format(extra="trainer.nnodes=1").split()[3:]).replace("\\ ", "")
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\n" + body.format(launch=launch, group=GROUP))
    monkeypatch.chdir(tmp_path)
    first = json.loads(cli("audit", "run.sh", "--format", "json").out)
    (launch_json,) = first["scripts"][0]["launches"]
    assert launch_json["verdict"] == "unverified", (shape, launch_json)
    command = launch_json["settle"]
    text = cli("audit", "run.sh").out
    assert f"to settle it, audit with the values the run gets: {command}" in text
    words = shlex.split(command)
    names = [w.split("=", 1)[0] for w in words if "=" in w and not w.startswith("-")]
    shell = {**os.environ, **dict.fromkeys([n.removeprefix("--env ") for n in names], value)}
    expanded = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, env=shell, check=True
    ).stdout.split("\0")[:-1]
    assert expanded[:2] == ["verl-safe-launch", "audit"]
    rerun = cli(*expanded[1:], "--format", "json")
    assert rerun.out.startswith("{"), (command, expanded, rerun)
    second = json.loads(rerun.out)
    verdicts = [launch["verdict"] for s in second["scripts"] for launch in s["launches"]]
    assert verdicts and all(v in ("go", "no-go") for v in verdicts), (shape, command, second)


def test_the_documented_pre_commit_hook_audits_the_changed_scripts(repo: Path, cli: Cli) -> None:
    """The docs' ``repo: local`` hook is the packaged hook run from the environment: same entry and files; its
    entry, given the files its pattern selects (as pre-commit passes them), gates on the broken one."""
    import re

    import yaml

    page = (Path(__file__).resolve().parent.parent / "docs" / "verbs" / "audit.md").read_text()
    block = page[page.index("```yaml\nrepos:\n  - repo: local") + len("```yaml\n") :]
    config = yaml.safe_load(block[: block.index("```")])
    (hook,) = config["repos"][0]["hooks"]
    (packaged,) = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / ".pre-commit-hooks.yaml").read_text()
    )
    assert config["repos"][0]["repo"] == "local" and hook["language"] == "system"
    assert {k: hook[k] for k in ("id", "entry", "files")} == {
        k: packaged[k] for k in ("id", "entry", "files")
    }
    changed = ["recipes/grpo.sh", "recipes/broken_batch.sh", "recipes/sft.sh", "tools/notes.md"]
    selected = [name for name in changed if re.search(hook["files"], name)]
    assert selected == changed[:3]
    words = hook["entry"].split()
    assert words[0] == "verl-safe-launch"
    assert cli(*words[1:], *(str(repo / name) for name in selected)).code == 1
    assert cli(*words[1:], *(str(repo / name) for name in selected if "broken" not in name)).code == 0

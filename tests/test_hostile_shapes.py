"""User input that used to end in a traceback (exit 4): every one is a compact error, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.doctor.postmortem import read_records
from verl_safe_launch.shell.words import MAX_NESTING

Cli = Callable[..., CliResult]
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "launch_examples" / "grpo_6gpu.yaml")
SCRIPT = str(ROOT / "launch_examples" / "run_grpo.sh")
BAD_NAME = os.fsdecode(b"o\xff")
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 3 has a total capacity of "
    "23.64 GiB of which 100.25 MiB is free. Including non-PyTorch memory, this process has 23.53 GiB memory in use.\n"
)


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


@pytest.mark.parametrize(
    ("text", "first", "node"),
    [
        ("data: [1, 2]\n", "error: cannot set data=[1, 2]: Cannot merge DictConfig with ListConfig", "data"),
        (
            'trainer:\n  project_name: "${"\n',
            "error: cannot set trainer.project_name=${: no viable alternative at input '${'",
            "trainer.project_name",
        ),
        (
            "trainer:\n  logger: {a: 1}\n",
            "error: cannot set trainer.logger.a=1: invalid literal for int()",
            "trainer.logger",
        ),
    ],
    ids=["list-for-mapping", "broken-interpolation", "mapping-for-list"],
)
@pytest.mark.parametrize("verb", ["check", "show", "run", "oom"])
def test_a_file_value_of_the_wrong_shape_is_an_input_error(
    tmp_path: Path, cli: Cli, verb: str, text: str, first: str, node: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    if verb == "oom":  # a run directory whose config.yaml was edited by hand
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(text)
        (run_dir / "worker.err").write_text(OOM)
        result = cli("oom", str(run_dir))
        shown = run_dir / "config.yaml"
    else:
        extra = ["--dry-run", "--run-dir", str(tmp_path / "rd")] if verb == "run" else []
        result = cli(verb, *extra, "-c", str(path))
        shown = path
    lines = result.err.splitlines()
    assert result.code == 2
    assert lines[0].startswith(first)
    assert lines[1].startswith(f"  where: user file, {shown}:")
    assert lines[2] == (
        f"  fix: give {node} a value of the shape verl's config has there (see 'verl-safe-launch show --key {node}')"
    )
    assert not (tmp_path / "rd").exists()


def test_a_config_group_given_a_list_is_a_usage_error(cli: Cli) -> None:
    result = cli("show", "data=[1,2]")
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        "error: 'data=[1,2]': data is one of verl's config groups, which takes the name of a config file, "
        "not [1, 2]",
    )


def test_deeply_nested_defaults_in_a_script_are_refused_at_the_limit(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "nested.sh"
    value = "${A:-" * 200 + "x" + "}" * 200
    script.write_text(f"X={value}\npython3 -m verl.trainer.main_ppo trainer.project_name=$X\n")
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0  # valid bash
    result = cli("audit", str(script))
    assert result.code == 2
    assert f"error: cannot read {script}: expansions nested over {MAX_NESTING} deep (the limit)" in result.out
    ok = tmp_path / "ok.sh"
    nested = "${A:-" * 10 + "demo" + "}" * 10
    ok.write_text(f"X={nested}\npython3 -m verl.trainer.main_ppo trainer.project_name=$X\n")
    result = cli("audit", str(ok))
    assert result.code == 1 and "launch 1 of 1, 1 overrides" in result.out


def test_deeply_nested_json_in_memory_records_is_skipped(tmp_path: Path) -> None:
    good = {"stage": "actor_update", "time": 2.0, "peak_allocated_gib": 10.0}
    lines = ["[" * 100_000, json.dumps({"stage": "x", "time": "late"}), json.dumps(good)]
    (tmp_path / "memory-0.jsonl").write_text("\n".join(lines) + "\n")
    assert [r["stage"] for r in read_records(tmp_path)] == ["x", "actor_update"]


@pytest.mark.parametrize(
    "argv",
    [
        ["migrate", SCRIPT, "-o", f"{BAD_NAME}.yaml"],
        ["upgrade", SCRIPT, "-o", f"{BAD_NAME}.sh"],
        ["slurm", "-c", EXAMPLE, "--gpus-per-node", "6", "-o", f"{BAD_NAME}.sbatch"],
        ["run", "--dry-run", "-c", EXAMPLE, "--run-dir", f"{BAD_NAME}.rd"],
        ["run", "--dry-run", "-c", f"{BAD_NAME}.yaml", "--run-dir", "ok.rd"],
    ],
    ids=["migrate", "upgrade", "slurm", "run-dir", "run-input"],
)
def test_a_name_that_is_not_valid_utf8_is_refused_before_writing(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / f"{BAD_NAME}.yaml").write_bytes(Path(EXAMPLE).read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VSL_HARDWARE_DETECT": "0"}
    code = "import sys; from verl_safe_launch.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "o\\xff" in err and "is not valid text in this locale's encoding (utf-8)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{BAD_NAME}.yaml"]


def test_a_non_ascii_name_under_an_ascii_locale_is_refused(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LC_ALL": "C",
        "PYTHONUTF8": "0",
        "PYTHONCOERCECLOCALE": "0",
        "VSL_HARDWARE_DETECT": "0",
    }
    code = "import sys; from verl_safe_launch.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["migrate", SCRIPT, "-o", "ö.yaml"]
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2
    assert b"is not valid text in this locale's encoding (ascii)" in result.stderr
    assert list(tmp_path.iterdir()) == []

"""The show verb, the CLI's error handling, and the import boundary (no torch, ray or verl modules)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult

BIN = Path(sys.executable).parent


def test_show_key_origin_names_cli_position_and_verl_file(cli: Callable[..., CliResult]) -> None:
    result = cli(
        "show",
        "data.train_batch_size=60",
        "actor_rollout_ref.rollout.n=12",
        "--key",
        "data.train_batch_size",
        "--origin",
    )
    assert result.code == 0
    assert result.out.splitlines()[:3] == [
        "data.train_batch_size = 60",
        "    from command line, argument 2 (data.train_batch_size=60)",
        "    replaced 1024 from verl default, verl/trainer/config/data/legacy_data.yaml:42",
    ]


def test_show_chain_file_then_cli(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    user = tmp_path / "run.yaml"
    user.write_text("data:\n  train_batch_size: 32\n")
    result = cli(
        "show", "-c", str(user), "data.train_batch_size=48", "--key", "data.train_batch_size", "--origin"
    )
    assert result.out.splitlines()[1:4] == [
        "    from command line, argument 4 (data.train_batch_size=48)",
        f"    replaced 32 from user file, {user}:2",
        "    replaced 1024 from verl default, verl/trainer/config/data/legacy_data.yaml:42",
    ]


def test_show_yaml_subtree_and_json(cli: Callable[..., CliResult]) -> None:
    result = cli("show", "--key", "data", "data.train_batch_size=60")
    assert "train_batch_size: 60\n" in result.out
    as_json = json.loads(cli("show", "--key", "data.train_batch_size", "--origin", "--format", "json").out)
    (entry,) = as_json["keys"]
    assert entry["value"] == 1024 and entry["source"]["file"] == "verl/trainer/config/data/legacy_data.yaml"


def test_show_example_file(cli: Callable[..., CliResult]) -> None:
    result = cli("show", "--origin", "-c", str(EXAMPLES / "grpo_6gpu.yaml"))
    assert "actor_rollout_ref.rollout.n = 12\n    from user file, " in result.out


@pytest.mark.parametrize(
    ("argv", "stderr"),
    [
        (["frobnicate"], "error: unknown verb 'frobnicate'\n  where: command line, argument 1\n"),
        (["show", "--bogus"], "error: unrecognized arguments: --bogus\n"),
        (["show", "--key", "data.nope"], "error: no key 'data.nope' in the composed config\n"),
        (["show", "-c", "/nonexistent/x.yaml"], "error: file not found: /nonexistent/x.yaml\n"),
        (
            ["show", "data.train_bach_size=1"],
            "error: unknown key 'data.train_bach_size': verl's config has no such key\n"
            "  where: command line, argument 2 (data.train_bach_size=1)\n"
            "  fix: did you mean 'data.train_batch_size'?\n",
        ),
    ],
)
def test_user_errors_are_compact_exit_2(cli: Callable[..., CliResult], argv: list[str], stderr: str) -> None:
    result = cli(*argv)
    assert result.code == 2
    assert result.err.startswith(stderr)
    assert "Traceback" not in result.err


def test_full_error_env_shows_traceback() -> None:
    proc = subprocess.run(
        [str(BIN / "verl-safe-launch"), "show", "data.train_bach_size=1"],
        capture_output=True,
        text=True,
        env={"VSL_FULL_ERROR": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" in proc.stderr  # the traceback never changes the exit code


def test_console_script_and_module_entry_points() -> None:
    for argv in ([str(BIN / "verl-safe-launch")], [sys.executable, "-m", "verl_safe_launch"]):
        proc = subprocess.run(
            [*argv, "show", "--key", "trainer.nnodes", "trainer.nnodes=2"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert proc.stdout.splitlines() == [
            "trainer.nnodes = 2",
            "    from command line, argument 4 (trainer.nnodes=2)",
            "    replaced 1 from verl default, verl/trainer/config/ppo_trainer.yaml:168",
        ]


def test_show_imports_no_torch_ray_or_verl() -> None:
    code = (
        "import sys\n"
        "from verl_safe_launch.cli import main\n"
        "main(['show', '--origin', 'data.train_batch_size=60'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'verl', 'transformers'})\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in proc.stderr

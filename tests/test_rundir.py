"""The run directory: Hydra-style location, refusing a non-empty one, atomic writes, the reproducing command."""

from __future__ import annotations

import os
import shlex
import stat
import sys
from datetime import datetime
from pathlib import Path

import pytest

from verl_safe_launch.errors import UsageError
from verl_safe_launch.launch import atomic_write, auto_run_dir, prepare_run_dir, reproduce_command

NOW = datetime(2025, 3, 4, 5, 6, 7)


def test_auto_run_dir_follows_hydra_and_never_shares_a_directory(tmp_path: Path) -> None:
    first = auto_run_dir(NOW, tmp_path)
    assert first == tmp_path / "2025-03-04" / "05-06-07"
    assert first.is_dir()
    # A second launch in the same second gets its own directory, even before the first wrote anything.
    assert auto_run_dir(NOW, tmp_path) == tmp_path / "2025-03-04" / "05-06-07_1"
    assert auto_run_dir(NOW, tmp_path) == tmp_path / "2025-03-04" / "05-06-07_2"


def test_prepare_refuses_a_non_empty_directory_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine\n")
    with pytest.raises(UsageError) as info:
        prepare_run_dir(tmp_path, force=False)
    assert info.value.render().splitlines()[0] == f"error: run directory {tmp_path} is not empty"
    assert prepare_run_dir(tmp_path, force=True) == tmp_path
    assert (tmp_path / "keep.txt").read_text() == "mine\n"


def test_prepare_refuses_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        prepare_run_dir(target, force=True)


def test_atomic_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path: Path) -> None:
    path = tmp_path / "command.sh"
    atomic_write(path, "old\n")
    atomic_write(path, "#!/usr/bin/env bash\n", mode=0o755)
    assert path.read_text() == "#!/usr/bin/env bash\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["command.sh"]


def test_reproduce_command_quotes_every_argument_and_exports_the_ray_environment(tmp_path: Path) -> None:
    args = ["-c", "my run.yaml", "data.train_files=['a b.parquet']", "trainer.experiment_name=it's", "$HOME"]
    env = {"RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_MODE": "token", "UNRELATED": "x"}
    script = reproduce_command(args, tmp_path / "work dir", env).splitlines()
    assert script[:4] == [
        "#!/usr/bin/env bash",
        "# Reruns this launch: same working directory, environment for Ray, interpreter and arguments.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(tmp_path / 'work dir'))}",
    ]
    assert script[4:6] == ["export RAY_ADDRESS=10.0.0.1:6379", "export RAY_AUTH_MODE=token"]
    assert shlex.split(script[6]) == [sys.executable, "-m", "verl_safe_launch", "run", *args]
    assert len(script) == 7


def test_atomic_write_cleans_up_when_the_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(UsageError, match="disk full"):
        atomic_write(tmp_path / "config.yaml", "x: 1\n")
    assert list(tmp_path.iterdir()) == []

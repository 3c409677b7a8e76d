"""Ctrl-C at any moment: exit 130 with one line, and every file written whole or not at all.

The signals here are real: the process sends SIGINT to itself at the moment under test, with Python's own
Ctrl-C handler in place. ``bench/interrupts.py`` interrupts a whole ``run --dry-run`` at hundreds of moments.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_safe_launch import cli as cli_module
from verl_safe_launch import files
from verl_safe_launch.launch import rundir


@pytest.fixture(autouse=True)
def _ctrl_c_raises() -> Iterator[None]:
    """Python's Ctrl-C handler, even where the test runner ignores SIGINT."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_between_two_renames_lands_after_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal comes while the first of three files is renamed into place: all three are written, then the
    interrupt is raised."""
    rename = files._rename
    calls: list[Path] = []

    def interrupted(tmp: str, path: Path, where: str) -> None:
        if not calls:
            _ctrl_c()
        calls.append(path)
        rename(tmp, path, where)

    monkeypatch.setattr(files, "_rename", interrupted)
    targets = {tmp_path / f"{name}.txt": (name, 0o644) for name in ("a", "b", "c")}
    with pytest.raises(KeyboardInterrupt):
        files.write_files(targets, force=False)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "c.txt"]


def test_a_failed_rename_takes_back_the_new_files_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that refuses the third rename: the two new files already in place are removed again."""
    rename = files._rename

    def refusing(tmp: str, path: Path, where: str) -> None:
        if path.name == "c.txt":
            raise files.UsageError(f"cannot write {path}: No space left on device")
        rename(tmp, path, where)

    monkeypatch.setattr(files, "_rename", refusing)
    targets = {tmp_path / f"{name}.txt": (name, 0o644) for name in ("a", "b", "c")}
    with pytest.raises(files.UsageError):
        files.write_files(targets, force=False)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_the_run_files_leaves_no_empty_run_directory(tmp_path: Path) -> None:
    target = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt), rundir.created_run_dir(target, False, []) as made:
        assert made.is_dir()
        _ctrl_c()
    assert not target.exists()
    target.mkdir()  # a directory the user made is never removed
    with pytest.raises(KeyboardInterrupt), rundir.created_run_dir(target, False, []):
        _ctrl_c()
    assert target.is_dir()


def test_ctrl_c_on_the_first_line_of_main_is_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_module, "_tolerant_streams", _ctrl_c)
    assert cli_module.main(["presets"]) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"


def test_ctrl_c_while_the_first_is_reported_still_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def twice(argv: object = None) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "main", twice)
    with pytest.raises(SystemExit) as stopped:
        cli_module.console_main()
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"

"""One budget for everything a composition reads, and only regular files read, each with a cap.

The budget covers verl's own config files (the installed verl, a ``--verl`` copy, a vendored ``verl/``), the
preset and every ``-c`` file together. The commands run as subprocesses with a generous timeout: a hang is a
failure, and no figure of time is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA, ROOT

from verl_safe_launch.inputs import MAX_VALUES, verl_yaml_values

# About 23,500 values from 220 bytes (aliases count at every use): with verl's own files one copy is under the
# budget, two are not.
ALIASES = (
    "trainer:\n"
    "  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
    "  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    "  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "  e: [*d]\n"
)


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VSL_HARDWARE_DETECT": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "verl_safe_launch", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_verl_s_own_files_use_a_share_of_the_budget() -> None:
    used = verl_yaml_values()
    assert 5_000 < used < MAX_VALUES // 2


def test_copies_of_one_file_share_the_budget(tmp_path: Path) -> None:
    """Each copy alone composes; together they pass the budget at the copy that does, before any is built."""
    (tmp_path / "bomb.yaml").write_text(ALIASES)
    assert len(ALIASES) < 300
    alone = _cli("show", "-c", "bomb.yaml", "--key", "trainer.a", cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    copies = []
    for n in range(4):
        (tmp_path / f"copy{n}.yaml").write_text(ALIASES)
        copies += ["-c", f"copy{n}.yaml"]
    done = _cli("check", *copies, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    first = done.stderr.splitlines()[0]
    assert first.startswith("error: copy1.yaml passes the 50,000 YAML values one composition may read")
    assert "verl's config files, copy0.yaml" in first


def _fake_verl(folder: Path, extra: str) -> Path:
    """A verl copy holding the installed release's config files and one more file."""
    import shutil

    import verl

    installed = Path(verl.__file__).parent
    package = folder / "verl"
    shutil.copytree(installed / "trainer" / "config", package / "trainer" / "config")
    shutil.copytree(installed / "version", package / "version")
    (package / "__init__.py").write_text("")
    (package / "trainer" / "config" / "extra.yaml").write_text(extra)
    return folder


def test_an_alias_bomb_in_a_verl_copy_is_refused_before_hydra_reads_it(tmp_path: Path) -> None:
    bomb = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
    )
    copy = _fake_verl(tmp_path / "copy", bomb)
    done = _cli("check", "--verl", str(copy), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "extra.yaml expands to more than" in done.stderr or "passes the 50,000 YAML values" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_interpolation_bomb_in_a_verl_copy_stops_at_the_limit(tmp_path: Path) -> None:
    lines = [
        "trainer:",
        "  x0: ab",
        *(f"  x{i}: ${{trainer.x{i - 1}}}${{trainer.x{i - 1}}}" for i in range(1, 20)),
    ]
    copy = _fake_verl(tmp_path / "copy", "")
    config = copy / "verl" / "trainer" / "config" / "ppo_trainer.yaml"
    config.write_text(
        config.read_text()
        + "\n".join(lines).replace("trainer:\n", "interp:\n").replace("trainer.x", "interp.x")
        + "\n"
    )
    done = _cli("check", "--verl", str(copy), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: interpolation limit: ") and "interp.x" in done.stderr
    assert "verl/trainer/config/ppo_trainer.yaml:" in done.stderr  # where: the copy's own file


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_verl_copy_whose_config_file_is_not_regular_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    copy = _fake_verl(tmp_path / "copy", "")
    odd = copy / "verl" / "trainer" / "config" / "odd.yaml"
    if kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.symlink_to("/dev/zero")
    done = _cli("check", "--verl", str(copy), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "odd.yaml is a " in done.stderr and "not a regular file" in done.stderr


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_oom_on_a_run_directory_with_a_fifo_or_dev_zero_for_records(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "worker.log").write_text((DATA / "oom" / "entropy_update_actor.log").read_text())
    odd = run / "memory-0.jsonl"
    if kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.symlink_to("/dev/zero")
    done = _cli("oom", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "update_actor" in done.stdout
    zero = tmp_path / "zero.log"
    zero.symlink_to("/dev/zero")
    named = _cli("oom", str(zero), cwd=tmp_path)
    assert named.returncode == 2 and "zero.log is a character device, not a regular file" in named.stderr

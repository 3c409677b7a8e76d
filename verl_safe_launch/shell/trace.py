"""Run a launch script under real bash with the launchers replaced by recorders, and read back what they got."""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.errors import InputError
from verl_safe_launch.files import read_input
from verl_safe_launch.shell.contain import FILE_LIMIT, check_timeout, remove_tree, run_contained
from verl_safe_launch.shell.trace_init import RECORDERS

RECORDED = ("python", "python3", "torchrun", "uv", "ray", "srun")
"""Commands replaced by recorders: whatever the script runs through them is recorded, not run."""

_END = "\x01"


def _recorder(record: Path) -> str:
    """A recorder: appends its name and arguments to ``record``, whose path it holds itself (a script that
    changes its environment cannot send the record elsewhere)."""
    target = shlex.quote(str(record))
    return f"#!/bin/bash\nprintf '%s\\0' \"${{0##*/}}\" \"$@\" >> {target}\nprintf '\\001\\0' >> {target}\n"


@dataclass(frozen=True)
class Trace:
    """Every recorded command line (the command's name first), in the order bash ran them, bash's exit, the
    last bytes of its stderr and how it was contained."""

    calls: tuple[tuple[str, ...], ...]
    returncode: int
    stderr: str
    containment: str = ""


def trace_script(
    path: Path, env: dict[str, str] | None = None, timeout: float = 30.0, args: tuple[str, ...] = ()
) -> Trace:
    """Run ``bash path args...`` in an empty temporary directory, with an empty environment plus ``env``.

    This executes the script, contained as far as this machine allows (see ``contain``): only the commands in
    ``RECORDED`` are replaced (by recorders on ``PATH``). Every process it starts is killed when bash exits or
    at ``timeout``, and the temporary directory is always removed.
    """
    check_timeout(timeout)
    script = Path(path).resolve()
    if not script.is_file():
        raise InputError(f"script not found: {path}", fix="check the path of the launch script")
    root = Path(tempfile.mkdtemp(prefix="vsl-trace-"))
    try:
        return _trace_in(root, script, path, env or {}, timeout, args)
    finally:
        remove_tree(root)


def _trace_in(
    root: Path, script: Path, path: Path, env: dict[str, str], timeout: float, args: tuple[str, ...]
) -> Trace:
    bindir = root / RECORDERS
    bindir.mkdir()
    record = root / ".vsl-calls"
    record.touch()
    for name in RECORDED:
        recorder = bindir / name
        recorder.write_text(_recorder(record))
        recorder.chmod(0o755)
    work = root / "work"
    work.mkdir()
    run_env = {**env, "PATH": f"{bindir}:/usr/bin:/bin"}
    done = run_contained(["/bin/bash", str(script), *args], root, work, run_env, timeout)
    if done is None:
        raise InputError(
            f"{path} did not finish within {timeout:g} s under --trace",
            fix="raise --timeout, or audit it without --trace",
        )
    # the script could replace the record (a FIFO, a link to /dev/zero): read only a regular file, capped
    data = read_input(
        record, what="trace record", where=f"{path} under --trace", limit=FILE_LIMIT, follow=False
    )
    return Trace(_calls(data.decode("utf-8", "replace")), done.returncode, done.stderr, done.containment)


def _calls(data: str) -> tuple[tuple[str, ...], ...]:
    calls: list[tuple[str, ...]] = []
    current: list[str] = []
    for item in data.split("\0")[:-1]:
        if item == _END:
            calls.append(tuple(current))
            current = []
        else:
            current.append(item)
    return tuple(calls)


__all__ = ["RECORDED", "Trace", "trace_script"]

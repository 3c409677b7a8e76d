"""Run a launch script under real bash with the launchers replaced by recorders, and read back what they got."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.errors import InputError
from verl_safe_launch.shell.contain import FILE_LIMIT, check_timeout, remove_tree, run_contained

RECORDED = ("python", "python3", "torchrun", "uv", "ray", "srun")
"""Commands replaced by recorders: whatever the script runs through them is recorded, not run."""

_END = "\x01"
_RECORDER = """#!/bin/bash
printf '%s\\0' "${0##*/}" "$@" >> "$VSL_TRACE_FILE"
printf '\\001\\0' >> "$VSL_TRACE_FILE"
"""


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
    bindir = root / ".vsl-bin"
    bindir.mkdir()
    for name in RECORDED:
        recorder = bindir / name
        recorder.write_text(_RECORDER)
        recorder.chmod(0o755)
    record = root / ".vsl-calls"
    record.touch()
    work = root / "work"
    work.mkdir()
    run_env = {**env, "PATH": f"{bindir}:/usr/bin:/bin", "VSL_TRACE_FILE": str(record)}
    done = run_contained(["/bin/bash", str(script), *args], root, work, run_env, timeout)
    if done is None:
        raise InputError(
            f"{path} did not finish within {timeout:g} s under --trace",
            fix="raise --timeout, or audit it without --trace",
        )
    with record.open("rb") as calls:
        data = calls.read(FILE_LIMIT)
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

"""Run a launch script under real bash with the launchers replaced by recorders, and read back what they got."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.errors import InputError

RECORDED = ("python", "python3", "torchrun", "uv", "ray", "srun")
"""Commands replaced by recorders: whatever the script runs through them is recorded, not run."""

_END = "\x01"
_RECORDER = """#!/bin/bash
printf '%s\\0' "${0##*/}" "$@" >> "$VSL_TRACE_FILE"
printf '\\001\\0' >> "$VSL_TRACE_FILE"
"""


@dataclass(frozen=True)
class Trace:
    """Every recorded command line (the command's name first), in the order bash ran them, and bash's exit."""

    calls: tuple[tuple[str, ...], ...]
    returncode: int
    stderr: str


def trace_script(
    path: Path, env: dict[str, str] | None = None, timeout: float = 30.0, args: tuple[str, ...] = ()
) -> Trace:
    """Run ``bash path args...`` in an empty temporary directory, with an empty environment plus ``env``.

    This executes the script: only the commands in ``RECORDED`` are replaced (by recorders on ``PATH``).
    """
    script = Path(path).resolve()
    if not script.is_file():
        raise InputError(f"script not found: {path}", fix="check the path of the launch script")
    with tempfile.TemporaryDirectory(prefix="vsl-trace-") as tmp:
        root = Path(tmp)
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
        run_env = {**(env or {}), "PATH": f"{bindir}:/usr/bin:/bin", "VSL_TRACE_FILE": str(record)}
        try:
            done = subprocess.run(
                ["/bin/bash", str(script), *args],
                cwd=work,
                env=run_env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise InputError(
                f"{path} did not finish within {timeout:g} s under --trace",
                fix="raise --timeout, or audit it without --trace",
            ) from None
        calls = _calls(record.read_bytes().decode("utf-8", "replace"))
        stderr = done.stderr.decode("utf-8", "replace")
        return Trace(calls, done.returncode, stderr)


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

"""Ctrl-C at every moment of ``run --dry-run``: raise KeyboardInterrupt at the N-th line verl-safe-launch executes.

    python bench/interrupts.py [POINTS]

Counts the lines the package's own code executes in one warm ``verl-safe-launch run --dry-run`` (the console script's entry point) of the 6-GPU GRPO example, then
for POINTS moments spread evenly over them (default 200) runs the same command in a fork, interrupted there.
Each interrupted run must exit 130 with the one line ``interrupted (Ctrl-C)``, and leave its run directory either
absent, empty-free (removed) or complete. Prints the moments that did not, and the totals.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "verl_safe_launch") + os.sep
ARGS = [
    "run",
    "--dry-run",
    "-c",
    str(ROOT / "launch_examples" / "grpo_6gpu.yaml"),
    "hardware.gpu_memory_gb=80",
]
COMPLETE = {"command.sh", "config.yaml", "overrides.txt", "preflight.json", "provenance.json"}


def _traced(at: int | None) -> tuple[Any, int]:
    """``main(ARGS)`` traced: (its outcome, the lines it ran); KeyboardInterrupt raised at line ``at``."""
    from verl_safe_launch.cli import console_main

    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "line":
            count += 1
            if count == at:
                raise KeyboardInterrupt
        return tracer

    folder = tempfile.mkdtemp(prefix="vsl-interrupts-")
    err = io.StringIO()
    sys.settrace(tracer)
    try:
        sys.argv = ["verl-safe-launch", *ARGS, "--run-dir", f"{folder}/run"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            console_main()
        code: object = "returned"
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # what escaped the console script would be a traceback
        code = f"escaped {type(exc).__name__}"
    finally:
        sys.settrace(None)
    run = Path(folder, "run")
    files = sorted(p.name for p in run.iterdir()) if run.is_dir() else None
    shutil.rmtree(folder, ignore_errors=True)
    return {"at": at, "code": code, "err": err.getvalue().strip()[-300:], "files": files}, count


def _in_fork(at: int) -> dict[str, Any]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        outcome, _ = _traced(at)
        os.write(write, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        data = stream.read()
    os.waitpid(pid, 0)
    found: dict[str, Any] = json.loads(data)
    return found


def _odd(outcome: dict[str, Any]) -> bool:
    if outcome["code"] == 0:
        return False  # the interrupt came after the last line of this run (runs differ by a few lines)
    clean = outcome["files"] is None or set(outcome["files"]) == COMPLETE
    return not (outcome["code"] == 130 and clean and outcome["err"].endswith("interrupted (Ctrl-C)"))


def main() -> None:
    os.environ["VSL_HARDWARE_DETECT"] = "0"
    points = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    _traced(None)  # warm: caches and verl's imports, as in every run after the first
    _, total = _traced(None)
    step = max(1, total // points)
    moments = list(range(2, total, step))  # at line 1 (the entry point's first) no handler can be in place
    odd = [o for o in (_in_fork(at) for at in moments) if _odd(o)]
    for outcome in odd:
        print(json.dumps(outcome))
    print(
        f"{total:,} lines of verl-safe-launch per run; interrupted at {len(moments)} moments: {len(odd)} odd"
    )


if __name__ == "__main__":
    main()

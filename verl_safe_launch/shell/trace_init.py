"""The first process of a ``--trace``: it runs bash, then kills everything bash left behind.

Run as ``python -I -S trace_init.py ROOT FSIZE READONLY -- COMMAND...`` (standard library only, nothing of
this package is imported). It leads its own session and is the subreaper of the script's processes (PID 1 in a
PID namespace, where there is one): every background child, ``nohup``-ed, ``setsid``-ed or double-forked
process ends up as its child or in its session, and all are killed when bash exits or when it gets SIGTERM.
With READONLY=1 (in a fresh mount namespace) every mount is made read-only except ROOT, the trace's own
directory, and ROOT/.vsl-bin (the recorders) is a read-only mount of its own. No file the script writes may
grow past FSIZE bytes. COMMAND runs through ``seal.py`` (no capability, no new privileges, no mount, namespace
or ptrace call), and never runs when the seal fails. What applied is written as JSON to this process's stdout,
which the script does not inherit (its stdout is /dev/null).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

PR_SET_CHILD_SUBREAPER = 36
ROUNDS = 100
RECORDERS = ".vsl-bin"
_SEAL = str(Path(__file__).with_name("seal.py"))


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, session)`` of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[3])


def _processes() -> Iterator[tuple[int, int, int]]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                yield int(entry), *found


def _left_behind(me: int) -> set[int]:
    """Every process in this session or descended from this one (orphans are reparented to it)."""
    table = {pid: (ppid, sid) for pid, ppid, sid in _processes() if pid != me}
    chosen = {pid for pid, (_, sid) in table.items() if sid == me}
    frontier = {me}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier and pid not in chosen}
        chosen |= frontier
    return chosen


def kill_all() -> None:
    """SIGKILL every process left behind, and reap them, until none is left (or after ROUNDS rounds)."""
    me = os.getpid()
    for _ in range(ROUNDS):
        left = _left_behind(me)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _reap()
        if not left:
            return


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _readonly(root: str) -> tuple[int, int]:
    """Bind ROOT and its recorders onto themselves, then remount every mount but ROOT read-only:
    (remounted, refused)."""
    recorders = os.path.join(root, RECORDERS)
    for target in (root, recorders):
        subprocess.run(["mount", "--bind", target, target], check=True, capture_output=True)
    done = failed = 0
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].encode().decode("unicode_escape")
        if target == root:
            continue
        ran = subprocess.run(["mount", "-o", "remount,bind,ro", target], capture_output=True, check=False)
        done, failed = (done + 1, failed) if ran.returncode == 0 else (done, failed + 1)
    return done, failed


def _stop(signum: int, frame: FrameType | None) -> None:
    kill_all()
    os._exit(128 + signum)


def main(argv: list[str]) -> int:
    """Contain, run the command, kill what it left behind; bash's exit status."""
    root, fsize, readonly = argv[0], int(argv[1]), argv[2] == "1"
    command = argv[argv.index("--") + 1 :]
    if os.getpid() != 1:  # as PID 1 it stays in unshare's group, so that the launcher's SIGTERM reaches it
        with contextlib.suppress(OSError):
            os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    remounted = _readonly(root) if readonly else (0, 0)
    os.chdir(os.getcwd())  # through ROOT's new, writable mount
    report: dict[str, object] = {
        "subreaper": subreaper,
        "pid": os.getpid(),
        "remounted": remounted[0],
        "refused": remounted[1],
    }
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop)
    child, report["seal"] = _sealed(command)
    sys.stdout.write(json.dumps(report))
    sys.stdout.close()
    code = child.wait()
    kill_all()
    return code if code >= 0 else 128 - code


def _sealed(command: list[str]) -> tuple[subprocess.Popen[bytes], object]:
    """Start COMMAND through the seal; the seal's report (``{"error": ...}`` when it refused to run it)."""
    status, status_w = os.pipe()
    seal = [sys.executable, "-I", "-S", _SEAL, str(status_w), "--", *command]
    child = subprocess.Popen(seal, pass_fds=(status_w,), stdout=subprocess.DEVNULL)
    os.close(status_w)
    with os.fdopen(status, "rb") as stream:
        data = stream.read(4096)
    try:
        return child, json.loads(data)
    except ValueError:
        return child, {"error": "the seal did not report"}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

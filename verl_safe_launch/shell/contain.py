"""Run a command contained as far as this machine allows: namespaces, its own session, capped output."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.errors import UsageError

MAX_TIMEOUT_S = 3600.0
OUTPUT_TAIL = 64 * 1024
"""Bytes of the script's stderr kept (the last ones); the rest is read and dropped, stdout is discarded."""
FILE_LIMIT = 64 * 1024 * 1024
"""No file the script writes may grow past this (RLIMIT_FSIZE); the recorders' file is one of them."""
GRACE_S = 5.0
REPORT_LIMIT = 4096
"""Bytes of the first process's report read (it writes one short JSON object on its own stdout)."""
_INIT = Path(__file__).with_name("trace_init.py")
_NAMESPACES = ("--mount", "--pid", "--fork", "--mount-proc", "--net", "--ipc", "--uts", "--kill-child")
_USER = ("--user", "--map-root-user")
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Containment:
    """How a traced script is contained: the command prefix and its description."""

    prefix: tuple[str, ...]
    namespaces: bool

    def describe(self, report: dict[str, object]) -> str:
        """One line saying what applied (``report`` is what the first process wrote)."""
        sealed = _sealed(report.get("seal"))
        if not self.namespaces:
            return (
                "contained: own session, process group and subreaper (all killed at the end), "
                f"{sealed}, empty environment, launcher non-dumpable, output and file sizes capped; no namespaces "
                f"(unshare is {'refused' if shutil.which('unshare') else 'missing'}): "
                "the file system, the network and other processes are reachable"
            )
        user = "user, " if _USER[0] in self.prefix else ""
        refused = report.get("refused", 0)
        files = (
            "read-only except its directory (the recorders read-only too)"
            if not refused
            else f"read-only but {refused} mounts (refused)"
        )
        return (
            f"contained: new {user}PID, mount, network, IPC and UTS namespaces (all killed at the end), "
            f"{sealed}, empty environment, output and file sizes capped, file system {files}, no network"
        )


def _sealed(seal: object) -> str:
    """What the seal applied, as the first process reported it."""
    if not isinstance(seal, dict) or "error" in seal:
        return "NOT sealed"
    calls = (
        "mount, namespace and ptrace calls refused (seccomp)"
        if seal.get("seccomp")
        else f"no seccomp filter on {seal.get('machine', 'this machine')}"
    )
    return f"no capabilities, no new privileges, {calls}"


@dataclass(frozen=True)
class Finished:
    """A contained command's exit status, the tail of its stderr and what applied."""

    returncode: int
    stderr: str
    containment: str


def check_timeout(seconds: float) -> float:
    """``--timeout``: a finite number of seconds in (0, MAX_TIMEOUT_S], else a usage error."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise UsageError(
            f"--timeout {seconds:g} is not a number of seconds from 0 to {MAX_TIMEOUT_S:g}",
            where="--timeout",
            fix="e.g. --timeout 60 (the default is 30)",
        )
    return seconds


@functools.cache
def containment() -> Containment:
    """The strongest containment this machine allows: user namespaces, then namespaces as root, then none."""
    unshare = shutil.which("unshare")
    candidates = [(unshare, *_USER, *_NAMESPACES), (unshare, *_NAMESPACES)] if unshare else []
    with tempfile.TemporaryDirectory(prefix="vsl-probe-") as probe_dir:
        for prefix in candidates:
            probe = [*prefix, "--", "mount", "--bind", probe_dir, probe_dir]
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0:
                    return Containment(tuple(str(p) for p in prefix), namespaces=True)
    return Containment((), namespaces=False)


class _Tail:
    """Reads a pipe to its end in a daemon thread, keeping only the last ``limit`` bytes."""

    def __init__(self, stream: io.BufferedReader, limit: int) -> None:
        self.kept: deque[bytes] = deque()
        self.size = 0
        self.limit = limit
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: io.BufferedReader) -> None:
        with stream:
            while chunk := stream.read1(65536):
                self.kept.append(chunk)
                self.size += len(chunk)
                while self.size - len(self.kept[0]) >= self.limit:
                    self.size -= len(self.kept.popleft())

    def text(self) -> str:
        self.thread.join(GRACE_S)
        return b"".join(self.kept)[-self.limit :].decode("utf-8", "replace")


def run_contained(
    command: Sequence[str], root: Path, cwd: Path, env: dict[str, str], timeout: float
) -> Finished | None:
    """Run ``command`` in ``cwd`` contained, with exactly ``env``; None when it ran past ``timeout``.

    Every process it started is killed when it ends or at the deadline, whichever comes first.
    """
    box = containment()
    readonly = "1" if box.namespaces else "0"
    init = [sys.executable, "-I", "-S", str(_INIT), str(root), str(FILE_LIMIT), readonly, "--", *command]
    proc = subprocess.Popen(
        [*box.prefix, *init],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_dies_with_launcher(signal.SIGKILL if box.namespaces else signal.SIGTERM),
    )
    assert isinstance(proc.stderr, io.BufferedReader) and isinstance(proc.stdout, io.BufferedReader)
    tail = _Tail(proc.stderr, OUTPUT_TAIL)
    said = _Tail(proc.stdout, REPORT_LIMIT)
    finished = False
    with _undumpable(), _terminated_as_exit():
        try:
            finished = _exited(proc.pid, time.monotonic() + timeout)
        finally:  # also on Ctrl-C: the script's session does not get the terminal's signals
            if not finished:  # the first process kills what the script started, then exits
                _signal_group(proc.pid, signal.SIGTERM)
                _exited(proc.pid, time.monotonic() + GRACE_S)
            _signal_group(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: its group id is its own
            code = proc.wait()
    if not finished:
        return None
    report = _report(said.text())
    seal = report.get("seal")
    if not isinstance(seal, dict) or "error" in seal:
        why = seal.get("error") if isinstance(seal, dict) else "the first process did not report"
        raise UsageError(
            f"--trace: the script was not run, it could not be sealed ({why})",
            where="--trace",
            fix="audit the script without --trace",
        )
    return Finished(code, tail.text(), box.describe(report))


@contextlib.contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """SIGTERM to the launcher (``timeout``, ``kill``, a scheduler) unwinds it as Ctrl-C does: the script's
    processes are killed and the trace's directory removed before it exits with 143. Only the main thread can
    set a handler; elsewhere the default stays (the first process still dies with the launcher)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _dies_with_launcher(signum: int) -> Callable[[], None]:
    """For the first process: the kernel sends it ``signum`` when the launcher dies, however it dies (SIGTERM,
    SIGKILL, a crash), where no ``finally`` of the launcher runs. ``unshare`` gets SIGKILL (it then kills the
    PID namespace, every process in it); the first process itself, without namespaces, gets SIGTERM and kills
    what the script started. Looked up before the fork: the child only makes the one call."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)

    return set_parent_death_signal


@contextlib.contextmanager
def _undumpable() -> Iterator[None]:
    """While the script runs, this process's ``/proc`` entries (its environment, its memory) are readable only
    by root: a script running as the same, non-root user cannot read the launcher's environment through them."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    try:
        yield
    finally:
        if before > 0:
            libc.prctl(_PR_SET_DUMPABLE, before, 0, 0, 0)


def _exited(pid: int, deadline: float) -> bool:
    """Wait for ``pid`` to exit, without reaping it, until ``deadline``."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _report(text: str) -> dict[str, object]:
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def remove_tree(root: Path) -> None:
    """Remove a directory the script may have made unwritable; never raises."""

    def unlock(fn: object, path: str, exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), 0o700)
            if os.path.islink(path):  # never follow a link the script left: it may point at the user's files
                os.unlink(path)
                return
            os.chmod(path, 0o700)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)

    shutil.rmtree(root, onerror=unlock)
    shutil.rmtree(root, ignore_errors=True)


__all__ = [
    "FILE_LIMIT",
    "MAX_TIMEOUT_S",
    "OUTPUT_TAIL",
    "Containment",
    "Finished",
    "check_timeout",
    "containment",
    "remove_tree",
    "run_contained",
]

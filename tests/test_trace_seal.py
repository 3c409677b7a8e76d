"""``--trace`` is sealed: a script cannot regain write access, shadow the recorders or leave its namespaces.

Each test runs a script that tries one known escape from the sandbox (as root inside its user namespace), then
proves the host unchanged: a file outside the trace's directory keeps its text, nothing new appears next to
it, the host's mount table is the same, and the launch the script ran after the attempt was recorded, not run.
A control shows the kernel itself allows the same escape to an unsealed root in such a namespace.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_safe_launch.shell import contain, trace_script

LAUNCH = "python3 -m verl.trainer.main_ppo"
SEAL = Path(contain.__file__).with_name("seal.py")
PYTHON = os.path.realpath(sys.executable)
"""The real interpreter by its absolute path: not a recorder, it runs inside the sandbox."""


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of the host the script must not change, and the trace's temporary directory in tmp_path."""
    if not contain.containment().namespaces:
        pytest.skip("this machine refuses namespaces (unshare): --trace says so and seals only the process")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    folder = tmp_path / "host"
    folder.mkdir()
    (folder / "file").write_text("original\n")
    mounts = Path("/proc/self/mounts").read_text()
    yield folder
    assert (folder / "file").read_text() == "original\n"
    assert sorted(p.name for p in folder.iterdir()) == ["file"]
    assert Path("/proc/self/mounts").read_text() == mounts
    assert list((tmp_path / "tmp").iterdir()) == []


def traced(tmp_path: Path, attempt: str) -> tuple[tuple[str, ...], ...]:
    """Run ``attempt``, then a launch; the recorded calls (the launch must be among them)."""
    script = tmp_path / "run.sh"
    script.write_text(f"{attempt}\n{LAUNCH} after=1\n")
    trace = trace_script(script, timeout=60)
    assert ("python3", "-m", "verl.trainer.main_ppo", "after=1") in trace.calls, trace.stderr
    return trace.calls


def write_to(path: Path) -> str:
    return f"echo escaped > {path}/file; echo escaped > {path}/new"


ESCAPES = {
    "remount the root read-write": "mount -o remount,bind,rw / && mount -o remount,rw /; {write}",
    "remount every mount read-write": (
        "for m in $(cut -d' ' -f2 /proc/self/mounts); do mount -o remount,bind,rw $m; done; {write}"
    ),
    "tmpfs over the recorders": "mount -t tmpfs none ../.vsl-bin",
    "tmpfs over the trace directory": "mount -t tmpfs none ..",
    "tmpfs over /tmp": "mount -t tmpfs none /tmp; mount -t tmpfs none {tmp}; {write}",
    "a bind mount over the recorders": "mount --bind /usr/bin ../.vsl-bin",
    "unmount the recorders": "umount -l ../.vsl-bin; umount ../.vsl-bin",
    "a nested user namespace": (
        "unshare -r -m sh -c 'mount -o remount,rw /; mount -t tmpfs none ../.vsl-bin; {write}'"
    ),
    "a nested namespace, then run python": "unshare -r -m sh -c 'mount -t tmpfs none ../.vsl-bin; python3 -c 1'",
    "nsenter the first process": "nsenter -t 1 -a sh -c '{write}'; nsenter --mount=/proc/1/ns/mnt sh -c '{write}'",
    "chroot": "/usr/sbin/chroot / sh -c '{write}'; /usr/sbin/chroot ../.vsl-bin /bin/sh",
    "replace the recorders": (
        "rm -f ../.vsl-bin/python3; mv ../.vsl-bin ../moved; chmod 777 ../.vsl-bin; "
        "printf '#!/bin/sh\\n' > ../.vsl-bin/python3"
    ),
}


@pytest.mark.parametrize("attempt", list(ESCAPES), ids=list(ESCAPES))
def test_an_escape_leaves_the_host_unchanged_and_the_recorders_in_place(
    host: Path, tmp_path: Path, attempt: str
) -> None:
    text = ESCAPES[attempt].format(write=write_to(host), tmp=tmp_path / "tmp")
    calls = traced(tmp_path, text)
    assert all(
        call[0] != "python3" or call[-1] == "after=1" for call in calls
    )  # python3 -c 1 was recorded too


PTRACE = (
    "import ctypes, sys\n"
    "parent = int(sys.argv[1])\n"  # the script's parent: the first process, which holds capabilities
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "attach = libc.ptrace(16, parent, 0, 0)\n"  # PTRACE_ATTACH
    "error = ctypes.get_errno()\n"
    "try:\n"
    "    open(f'/proc/{parent}/mem', 'rb').close()\n"
    "    mem = 'opened'\n"
    "except OSError as exc:\n"
    "    mem = exc.strerror\n"
    "print(attach, error, mem, sep=',')\n"
)


def test_the_script_cannot_ptrace_its_parent_or_forge_its_report(host: Path, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PTRACE)
    calls = traced(
        tmp_path,
        f'{LAUNCH} "ptrace=$({PYTHON} -I {probe} $PPID)"\n'
        'echo \'{"seal": {"error": "forged"}}\' > /proc/$PPID/fd/1\n'
        f'{LAUNCH} "status=$(grep -E "^(CapEff|CapBnd|NoNewPrivs|Seccomp):" /proc/self/status | tr -d ":" | tr -s "\\t\\n" "= ")"',
    )
    ptrace = next(c[-1] for c in calls if c[-1].startswith("ptrace="))
    attach, error, mem = ptrace.removeprefix("ptrace=").split(",")
    assert attach == "-1" and int(error) == errno.EPERM
    assert mem == "Permission denied"
    status = next(c[-1] for c in calls if c[-1].startswith("status="))
    assert "CapEff=0000000000000000" in status and "NoNewPrivs=1" in status
    assert "CapBnd=0000000000000000" in status
    assert ("Seccomp=2" in status) == (platform.machine() in ("x86_64", "aarch64"))


def test_the_containment_line_says_what_the_kernel_applied(host: Path, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"{LAUNCH} a=1\n")
    line = trace_script(script).containment
    assert "no capabilities, no new privileges" in line
    assert "file system read-only except its directory (the recorders read-only too)" in line


def test_without_the_seal_the_kernel_lets_root_in_the_namespace_remount(tmp_path: Path) -> None:
    """The control: the escapes above are real. Root in a user and mount namespace, with its capabilities,
    makes a read-only bind mount writable again; the seal is what stops it."""
    unshare = shutil.which("unshare")
    if unshare is None or not contain.containment().namespaces:
        pytest.skip("this machine refuses namespaces (unshare)")
    folder = tmp_path / "box"
    folder.mkdir()
    prefix = [p for p in contain.containment().prefix if p not in ("--pid", "--fork", "--mount-proc")]
    script = (
        f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
        f"! touch {folder}/ro 2>/dev/null && mount -o remount,bind,rw {folder} && touch {folder}/rw"
    )
    done = subprocess.run([*prefix, "--", "sh", "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["rw"]


SYSCALLS = (
    "import ctypes, json, os, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "import seal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "numbers = seal.ARCHES[os.uname().machine][1]\n"
    "sealed = seal.status().get('Seccomp') == '2'\n"
    "out = {}\n"
    "names = list(numbers) if sealed else []\n"  # unsealed, only the harmless probe below runs
    "for name in names:\n"
    "    args = (0x10000000 | 17,) if name == 'clone' else ()\n"  # CLONE_NEWUSER | SIGCHLD
    "    result = libc.syscall(numbers[name], *args, *([0] * (6 - len(args))))\n"
    "    out[name] = (result, ctypes.get_errno())\n"
    "out['unshare-user'] = (libc.unshare(0x10000000), ctypes.get_errno())\n"
    "print(json.dumps({'sealed': sealed, 'calls': out}))\n"
)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="no seccomp table for this machine"
)
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed"])
def test_every_refused_system_call_gets_eperm(tmp_path: Path, sealed: bool) -> None:
    """Each refused call, made for real in a sealed process, fails with EPERM (clone3 with ENOSYS, so the C
    library falls back to clone). Unsealed, a new user namespace is allowed: the filter is what refuses it."""
    probe = tmp_path / "probe.py"
    probe.write_text(SYSCALLS)
    command = [PYTHON, "-I", str(probe), str(SEAL.parent)]
    if sealed:
        read, write = os.pipe()
        command = [PYTHON, "-I", "-S", str(SEAL), str(write), "--", *command]
        done = subprocess.run(command, pass_fds=(write,), capture_output=True, text=True, check=False)
        os.close(write)
        with os.fdopen(read) as stream:
            report = json.loads(stream.read())
        assert report["capabilities"] == "none" and report["seccomp"] is True
    else:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["sealed"] is sealed
    calls = found["calls"]
    if not sealed:
        assert calls == {"unshare-user": [0, 0]}
        return
    assert calls.pop("clone3") == [-1, errno.ENOSYS]
    assert {name: tuple(result) for name, result in calls.items()} == dict.fromkeys(calls, (-1, errno.EPERM))
    assert len(calls) == 27

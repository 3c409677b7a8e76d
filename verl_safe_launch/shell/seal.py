"""Seal a traced script before it runs: no capability, no new privileges, no mount, namespace or ptrace call.

Run as ``python -I -S seal.py STATUS_FD -- COMMAND...`` (standard library only, nothing of this package is
imported). In this order it sets the secure bits that keep uid 0 from regaining capabilities at ``execve``,
drops every capability from the bounding set, clears the ambient set, zeroes the effective, permitted and
inheritable sets, sets ``no_new_privs`` and installs a seccomp filter that refuses (EPERM) ``mount``,
``umount2``, ``pivot_root``, ``chroot``, ``unshare``, ``setns``, ``ptrace``, ``process_vm_readv/writev``, the
new mount API, module and kexec loading, ``bpf``, ``perf_event_open``, ``userfaultfd`` and a ``clone`` that asks
for a new namespace (``clone3``, whose flags a filter cannot read, gets ENOSYS, so the C library falls back
to ``clone``). Then it reads back ``/proc/self/status``: only when every capability set is empty (the
bounding set too, where this process could empty it), ``NoNewPrivs`` is 1 and the filter is in place (on the
architectures it knows) does it write what applied to STATUS_FD as JSON and exec COMMAND. Otherwise it
writes ``{"error": ...}`` and exits 126 without running anything.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import sys
from pathlib import Path

PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
SECURE_BITS = 0xEF
"""NOROOT, NO_SETUID_FIXUP and NO_CAP_AMBIENT_RAISE, each locked, and KEEP_CAPS locked off."""
CAPABILITY_VERSION_3 = 0x20080522

EPERM, ENOSYS = 1, 38
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
NAMESPACE_FLAGS = 0x7E020000
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID and NEWNET."""
X32_BIT = 0x40000000

_NUMBERS = {  # name: (x86_64 from asm/unistd_64.h, aarch64 from the generic table)
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "open_tree_attr": (467, 467),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "clone": (56, 220),
    "clone3": (435, 435),
}
_REFUSED = tuple(name for name in _NUMBERS if not name.startswith("clone"))
ARCHES = {
    "x86_64": (0xC000003E, {name: pair[0] for name, pair in _NUMBERS.items()}),
    "aarch64": (0xC00000B7, {name: pair[1] for name, pair in _NUMBERS.items()}),
}
"""Machine → (its AUDIT_ARCH value, its system call numbers)."""


class _Filter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def bpf_program(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The filter for ``machine`` as (code, jt, jf, k) rows, or None for an architecture it does not know."""
    if machine not in ARCHES:
        return None
    audit_arch, numbers = ARCHES[machine]
    refused = [numbers[name] for name in _REFUSED]
    rows: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, audit_arch)]
    rows.append((_RET_K, 0, 0, RET_ERRNO | EPERM))  # another ABI (i386 on x86_64): refused outright
    rows.append((_LD_W_ABS, 0, 0, 0))
    if machine == "x86_64":
        rows.append((_JGE_K, 0, 1, X32_BIT))
        rows.append((_RET_K, 0, 0, RET_ERRNO | EPERM))
    for number in refused:
        rows.append((_JEQ_K, 0, 1, number))
        rows.append((_RET_K, 0, 0, RET_ERRNO | EPERM))
    rows.append((_JEQ_K, 0, 1, numbers["clone3"]))
    rows.append((_RET_K, 0, 0, RET_ERRNO | ENOSYS))
    rows.append((_JEQ_K, 0, 3, numbers["clone"]))
    rows.append((_LD_W_ABS, 0, 0, 16))  # the low half of the first argument: clone's flags
    rows.append((_JSET_K, 0, 1, NAMESPACE_FLAGS))
    rows.append((_RET_K, 0, 0, RET_ERRNO | EPERM))
    rows.append((_RET_K, 0, 0, RET_ALLOW))
    return rows


def _install_filter(libc: ctypes.CDLL, rows: list[tuple[int, int, int, int]]) -> None:
    array = (_Filter * len(rows))(*(_Filter(*row) for row in rows))
    program = _Program(len(rows), ctypes.cast(array, ctypes.POINTER(_Filter)))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    libc.prctl(
        PR_SET_SECUREBITS, SECURE_BITS, 0, 0, 0
    )  # needs CAP_SETPCAP: without it there is nothing to drop
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text().strip() or 63)
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset refused")


def status() -> dict[str, str]:
    """The fields of ``/proc/self/status`` the seal checks."""
    wanted = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in wanted:
            fields[name] = value.strip()
    return fields


def seal() -> dict[str, object]:
    """Seal this process (see the module's docstring); what applied, read back from the kernel."""
    libc = ctypes.CDLL(None, use_errno=True)
    _drop_capabilities(libc)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "no_new_privs refused")
    rows = bpf_program(platform.machine())
    if rows is not None:
        _install_filter(libc, rows)
    found = status()
    empty = all(int(found.get(name, "1"), 16) == 0 for name in ("CapInh", "CapPrm", "CapEff", "CapAmb"))
    if not empty or found.get("NoNewPrivs") != "1":
        raise OSError(0, f"capabilities still held: {found}")
    if rows is not None and found.get("Seccomp") != "2":
        raise OSError(0, f"seccomp filter not in place: {found}")
    return {
        "capabilities": "none",
        "bounding": int(found.get("CapBnd", "1"), 16) == 0,
        "no_new_privs": True,
        "seccomp": rows is not None,
        "machine": platform.machine(),
    }


def main(argv: list[str]) -> int:
    """Seal, report to the status descriptor, exec the command; 126 (nothing run) when sealing failed."""
    fd = int(argv[0])
    command = argv[argv.index("--") + 1 :]
    try:
        report: dict[str, object] = seal()
    except OSError as exc:
        report = {"error": f"{exc.strerror or exc}"}
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(report))
    if "error" in report:
        return 126
    os.execv(command[0], command)
    return 127  # pragma: no cover (execv does not return)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""After the test command: fail if the tests left a process running or a file outside their temp dirs.

Processes are found by the marker the CI run put in the tests' environment (every process they start inherits
it); files by what appeared in /tmp (Ray's /tmp/ray included), in the fresh HOME, in the fresh TMPDIR (pytest's
own ``pytest-of-*`` base directories excepted) and in the work tree (tool caches excepted). Leftover processes are
listed, then stopped by PID (they are the tests' own), so the machine is left as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATUS = ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"]
CACHES = (".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "__pycache__", ".egg-info")


def marked_processes(marker: str) -> dict[int, str]:
    """Live processes whose environment holds ``VSL_CI_MARK=marker``, with their command lines."""
    needle = f"VSL_CI_MARK={marker}".encode()
    mine = {os.getpid(), os.getppid()}
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if (entry / "stat").read_text().split(") ")[-1].startswith("Z"):
                continue  # a zombie holds nothing and goes with its parent
        except OSError:
            continue  # gone meanwhile, or not ours to read
        found[int(entry.name)] = cmdline[:200]
    return found


def files_under(root: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file or directory below ``root`` (relative), except top-level entries named in ``skip``."""
    out: list[str] = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name in skip or entry.name.startswith(skip):
            continue
        out.append(entry.name + ("/" if entry.is_dir() else ""))
        if entry.is_dir() and not entry.is_symlink():
            out.extend(f"{entry.name}/{sub}" for sub in files_under(entry))
    return out


def work_tree_extras(listing: list[str]) -> set[str]:
    """The untracked or ignored paths of a ``git status --porcelain --ignored`` listing, tool caches excepted."""
    paths = [line[3:] for line in listing if line[:2] in ("??", "!!")]
    return {p for p in paths if not any(part in CACHES or part.endswith(CACHES) for part in Path(p).parts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--tmpdir", type=Path, required=True)
    parser.add_argument("--tmp-before", type=Path, required=True)
    parser.add_argument("--ignore", default="", help="an entry of /tmp that is the CI run's own")
    parser.add_argument("--tree-before", type=Path, required=True, help="git status of the work tree before")
    args = parser.parse_args()
    problems: list[str] = []
    deadline = time.monotonic() + 20  # a process the tests stopped may take a moment to exit
    while (procs := marked_processes(args.marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, cmdline in procs.items():
        problems.append(f"process {pid} still running: {cmdline}")
    before = set(args.tmp_before.read_text().splitlines())
    added = sorted(set(os.listdir("/tmp")) - before - {args.ignore})
    problems += [f"new in /tmp: /tmp/{name}" for name in added]
    problems += [f"left in the fresh HOME: ~/{path}" for path in files_under(args.home)]
    problems += [f"left in TMPDIR: {path}" for path in files_under(args.tmpdir, ("pytest-of-",))]
    now = subprocess.run(STATUS, capture_output=True, text=True, check=True).stdout.splitlines()
    new = work_tree_extras(now) - work_tree_extras(args.tree_before.read_text().splitlines())
    problems += [f"left in the work tree: {path}" for path in sorted(new)]
    for problem in problems[:50]:
        print(f"leftovers: {problem}", file=sys.stderr)
    if len(problems) > 50:
        print(f"leftovers: ... and {len(problems) - 50} more", file=sys.stderr)
    for pid in procs:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if problems:
        print(f"leftovers: the tests left {len(problems)} thing(s) behind", file=sys.stderr)
        return 1
    print("leftovers: none (no process, no file outside the tests' temp dirs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Audit speed on real launch scripts, in one process: scripts per second, cold (the first pass, verl's defaults
composed on the way) and warm (the same scripts again).

    python bench/audit.py [FOLDER ...] [--limit N]

Without folders: tests/data/scripts/corpus/ and verl's own example scripts shipped for the tests
(tests/data/release_examples/: main-0.10.0.dev, v0.8.0, v0.7.1; VSL_BENCH_CORPUS names another folder of such
tags), the first 250 scripts that launch main_ppo. Each is audited against the installed verl.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from verl_safe_launch.backends import bringup_findings
from verl_safe_launch.preflight import Auditor, find_scripts

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [ROOT / "tests" / "data" / "scripts" / "corpus"]
CORPUS = Path(os.environ.get("VSL_BENCH_CORPUS", ROOT / "tests" / "data" / "release_examples"))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument("--limit", type=int, default=250)
    args = parser.parse_args()
    folders = args.folders or [
        *DEFAULT,
        *(CORPUS / t for t in ("main-0.10.0.dev", "v0.8.0", "v0.7.1") if (CORPUS / t).is_dir()),
    ]
    found = [f for f in find_scripts([str(f) for f in folders]) if f.skip is None]
    scripts = [f for f in found if "main_ppo" in Path(f.path).read_text(errors="replace")][: args.limit]
    os.environ["VSL_HARDWARE_DETECT"] = "0"
    auditor = Auditor(job_findings=bringup_findings)
    for label in ("cold", "warm"):
        wall, cpu = time.perf_counter(), time.process_time()
        launches = sum(len(auditor.script(Path(s.path), named=False).launches) for s in scripts)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(
            f"{label}: {len(scripts)} scripts ({launches} launches) in {wall:.1f} s wall, {cpu:.1f} s CPU: "
            f"{len(scripts) / wall:.1f} scripts/s (load average {os.getloadavg()[0]:.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cold ``show`` and ``check`` (a new process each) against the import floor ``python -c "import hydra, omegaconf"``.

Each command runs in a fresh process, in turns, ``--repeats`` times; the cache of what is derived from verl
(``$XDG_CACHE_HOME/verl-safe-launch``) is empty for the first ``show`` and ``check`` of the run (the
"first use" figures), then filled as a user's is. Prints medians and the ratio to the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "verl_safe_launch"]
COMMANDS = {
    "import floor": [sys.executable, "-c", "import hydra, omegaconf"],
    "show": [*CLI, "show"],
    "check": [*CLI, "check", "-c", "launch_examples/grpo_6gpu.yaml"],
}


def timed(cmd: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one run (its output discarded)."""
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main() -> None:
    """Run the comparison and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": str(ROOT)}
        env.pop("VSL_CACHE_DIR", None)
        first = {name: timed(COMMANDS[name], env) for name in ("show", "check")}
        runs: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(args.repeats):
            for name, cmd in COMMANDS.items():
                runs[name].append(timed(cmd, env))
    floor = statistics.median(runs["import floor"])
    print(f"load average {os.getloadavg()[0]:.1f}, {args.repeats} runs each, medians:")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"  {name:<13} {median:5.2f} s  ({median / floor:.2f}x the import floor)")
    for name, seconds in first.items():
        print(
            f"  {name:<13} {seconds:5.2f} s on first use (empty cache: verl's YAML composed, facts derived)"
        )


if __name__ == "__main__":
    main()

"""Wall time to the first report of an invalid config: ``verl-safe-launch check`` vs verl's own ``main_ppo``.

The config is the bundled 6-GPU example with ``data.train_batch_size=50`` (below the mini batch of 60): verl's
validate_config rejects it on the driver, so ``python -m verl.trainer.main_ppo`` prints its first validation error
and exits; ``check`` reports that error and every other one. Both run as fresh processes, median of N runs.

    .venv/bin/python bench/check_vs_verl.py [--runs 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "launch_examples" / "grpo_6gpu.yaml"
BREAK = "data.train_batch_size=50"


def flat_overrides(path: Path) -> list[str]:
    """The example YAML as ``key=value`` overrides (what a launch script would pass to verl)."""

    def walk(node: object, prefix: str) -> list[str]:
        if isinstance(node, dict):
            return [item for key, value in node.items() for item in walk(value, f"{prefix}{key}.")]
        value = "true" if node is True else "false" if node is False else node
        return [f"{prefix[:-1]}={value}"]

    return walk(yaml.safe_load(path.read_text()), "")


def timed(command: list[str], cwd: Path) -> tuple[float, int, str]:
    """Seconds until the process exits, its exit code, and the first error line about the batch size."""
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    output = (proc.stdout + proc.stderr).splitlines()
    lines = [ln for ln in output if "train_batch_size" in ln and re.search(r"error \[|\w+Error: ", ln)]
    return elapsed, proc.returncode, lines[0].strip() if lines else "(no error line names train_batch_size)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    ns = parser.parse_args()
    bindir = Path(sys.executable).parent
    ours = [str(bindir / "verl-safe-launch"), "check", "-c", str(EXAMPLE), BREAK]
    verl = [sys.executable, "-m", "verl.trainer.main_ppo", *flat_overrides(EXAMPLE), BREAK]
    results: dict[str, list[float]] = {"verl-safe-launch check": [], "python -m verl.trainer.main_ppo": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(ns.runs):
            for name, command in zip(results, (ours, verl), strict=True):
                elapsed, code, line = timed(command, Path(tmp))
                results[name].append(elapsed)
                print(f"{name}: {elapsed:.2f} s, exit {code}: {line[:150]}")
    medians = {name: statistics.median(times) for name, times in results.items()}
    for name, median in medians.items():
        print(f"median {name}: {median:.2f} s")
    ours_s, verl_s = medians.values()
    print(f"ratio check / main_ppo: {ours_s / verl_s:.2f} (target ≤ 0.20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Composition speed: in-process compose+provenance, and `show` vs verl's own `--cfg job` wall time."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OVERRIDES = [
    "data.train_batch_size=60",
    "actor_rollout_ref.rollout.n=12",
    "actor_rollout_ref.actor.ppo_mini_batch_size=60",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.n_gpus_per_node=6",
]
BIN = Path(sys.executable).parent


def in_process(repeats: int = 15) -> list[float]:
    """In-process timings of compose + provenance for the full verl config, the first (cold) one first.

    The first composition in a process builds Hydra's loader and verl's composed defaults; later ones reuse
    them (copied), as a process that composes many configs does.
    """
    from verl_safe_launch.compose import compose
    from verl_safe_launch.inputs import ComposeRequest, cli_tokens

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        composed = compose(ComposeRequest(overrides=cli_tokens(OVERRIDES)))
        times.append(time.perf_counter() - start)
    print(f"leaves with provenance: {len(composed.view.provenance)}")
    return times


def wall(argv: list[str], repeats: int = 3) -> float:
    """Median wall time of a command."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Print the figures."""
    print("load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    times = in_process()
    print(
        f"in-process compose+provenance: median {statistics.median(times) * 1000:.0f} ms over {len(times)} runs"
        f" (first, cold: {times[0] * 1000:.0f} ms; median of the rest {statistics.median(times[1:]) * 1000:.0f} ms)"
    )
    ours = wall([str(BIN / "verl-safe-launch"), "show", *OVERRIDES])
    verl = wall([sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", *OVERRIDES])
    print(f"verl-safe-launch show:                 {ours:.2f} s")
    print(f"python -m verl.trainer.main_ppo --cfg job: {verl:.2f} s")
    print(f"ratio show / verl --cfg job:           {ours / verl:.2f}")
    print("load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()

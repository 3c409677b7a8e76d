"""Memory-hook overhead: cost of one wrapped call (record written) against a CPU training-step workload.

The hook runs once per stage call (a handful per training step), so its cost is compared with one step of a
small CPU workload: forward + backward + optimizer step of a 4-layer MLP. A real verl stage on a GPU takes
seconds, so the percentage printed here is an upper bound. Target: at most 1%.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from verl_safe_launch.launch import RUN_DIR_ENV, STAGE_BY_NAME, wrap_stage

WIDTH = 512
BATCH = 256


class Worker:
    """The surface of verl's ActorRolloutRefWorker the hook reads, around a real CPU training step."""

    rank = 0

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        torch.set_num_threads(1)
        layers: list[Any] = []
        for _ in range(4):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batch = torch.randn(BATCH, WIDTH)
        engine = SimpleNamespace(
            use_dynamic_bsz=False, micro_batch_size_per_gpu=8, max_token_len_per_gpu=16384
        )
        self.actor = SimpleNamespace(engine_config=engine)

    def update_actor(self, data: object) -> float:
        loss = self.model(self.batch).pow(2).mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()
        return float(loss.detach())

    def empty(self, data: object) -> None:
        return None


def per_call(fn: Callable[[Any, object], object], worker: Worker, calls: int) -> float:
    """Median seconds per call over five rounds."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(worker, None)
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def main() -> None:
    """Print the step time, the hook's cost per call and the ratio."""
    spec = STAGE_BY_NAME["actor_update"]
    worker = Worker()
    with tempfile.TemporaryDirectory() as run_dir:
        os.environ[RUN_DIR_ENV] = run_dir
        empty_plain = per_call(Worker.empty, worker, 2000)
        empty_hooked = per_call(wrap_stage(Worker.empty, spec), worker, 2000)
        step_plain = per_call(Worker.update_actor, worker, 20)
        step_hooked = per_call(wrap_stage(Worker.update_actor, spec), worker, 20)
        lines = len(Path(run_dir, "memory-0.jsonl").read_text().splitlines())
    hook = empty_hooked - empty_plain
    print(
        f"CPU workload step (4-layer MLP fwd+bwd+AdamW, {BATCH}x{WIDTH}, 1 thread): {step_plain * 1e3:.2f} ms"
    )
    print(f"hook cost per wrapped call (record written, {lines} lines): {hook * 1e6:.1f} us")
    print(f"overhead per step from the hook cost: {hook / step_plain:.3%} (target <= 1%)")
    print(
        f"measured step with the hook: {step_hooked * 1e3:.2f} ms ({step_hooked / step_plain - 1:+.2%}, noisy)"
    )


if __name__ == "__main__":
    main()

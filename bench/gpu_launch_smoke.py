"""GPU smoke test of the memory hooks on a real CUDA workload (under 5 minutes on one GPU).

1. In-process: verl's stage names wrapped around a log-prob forward (full-vocabulary logits) and a training
   step of a small decoder-like model, for micro batches 1, 4, 8; each record's torch peak is checked against
   torch's own counter, and device use against ``mem_get_info``.
2. An out-of-memory error inside a wrapped stage: recorded with stage and settings, then the post-mortem.
3. On Ray: the hook installed through the runtime env in a worker of verl's own RayWorkerGroup holding one
   GPU (``RayResourcePool([1], use_gpu=True)``); the worker's record must say ``cuda: true``.

Exits 0 with a message where CUDA is absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from verl_safe_launch.launch import RUN_DIR_ENV, SETUP_HOOK, STAGE_BY_NAME, wrap_stage

VOCAB = 151_936
HIDDEN = 1024
LAYERS = 8
SEQ = 1024
MICROS = (1, 4, 8)


def build_model() -> Any:
    import torch

    layers: list[Any] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, HIDDEN)]
    body = torch.nn.Sequential(*layers)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    return torch.nn.ModuleDict({"body": body, "head": head}).cuda().to(torch.bfloat16)


class Worker:
    """The surface of ActorRolloutRefWorker the hook reads, around real CUDA work."""

    rank = 0

    def __init__(self, micro: int) -> None:
        import torch

        self.model = build_model()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        engine = SimpleNamespace(
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=micro,
            infer_micro_batch_size_per_gpu=micro,
            max_token_len_per_gpu=SEQ * micro,
            infer_max_token_len_per_gpu=SEQ * micro,
        )
        self.actor = SimpleNamespace(engine_config=engine)
        self.micro = micro

    def _logprobs(self) -> Any:
        import torch

        x = torch.randn(self.micro, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits = self.model["head"](self.model["body"](x)).float()
        return torch.log_softmax(logits, dim=-1).max(dim=-1).values

    def compute_log_prob(self, data: object) -> float:
        import torch

        with torch.no_grad():
            return float(self._logprobs().mean())

    def update_actor(self, data: object) -> float:
        loss = -self._logprobs().mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return float(loss.detach())

    def runs_out(self, data: object) -> None:
        import torch

        free, _ = torch.cuda.mem_get_info()
        torch.empty(int(free * 2), dtype=torch.uint8, device="cuda")


def in_process(run_dir: Path) -> bool:
    """Part 1: records vs torch's own counters, per stage and micro batch."""
    import torch

    ok = True
    print(f"{'stage':<14}{'micro':>6}{'peak GiB':>10}{'torch GiB':>11}{'device GiB':>12}{'s':>7}")
    for micro in MICROS:
        worker = Worker(micro)
        for method, stage in (("compute_log_prob", "old_log_prob"), ("update_actor", "actor_update")):
            wrapped = wrap_stage(getattr(Worker, method), STAGE_BY_NAME[stage])
            wrapped(worker, None)
            truth = torch.cuda.max_memory_allocated() / 2**30
            record = last_record(run_dir)
            ok &= record["cuda"] is True and abs(record["peak_allocated_gib"] - truth) < 0.01
            print(
                f"{stage:<14}{micro:>6}{record['peak_allocated_gib']:>10.2f}{truth:>11.2f}"
                f"{record['device_used_gib']:>12.2f}{record['duration_s']:>7.2f}"
            )
        del worker
        torch.cuda.empty_cache()
    return ok


def last_record(run_dir: Path) -> dict[str, Any]:
    lines = (run_dir / "memory-0.jsonl").read_text().splitlines()
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def out_of_memory(run_dir: Path) -> bool:
    """Part 2: an OOM inside a wrapped stage is recorded, and the post-mortem names the knob."""
    import torch

    from verl_safe_launch.compose import compose
    from verl_safe_launch.doctor import first_oom, load_fit, oom_report, read_records
    from verl_safe_launch.inputs import ComposeRequest
    from verl_safe_launch.preflight import rule_context

    worker = Worker(8)
    with contextlib.suppress(torch.OutOfMemoryError):
        wrap_stage(Worker.runs_out, STAGE_BY_NAME["actor_update"])(worker, None)
    del worker
    torch.cuda.empty_cache()
    record = first_oom(read_records(run_dir))
    if record is None:
        print("FAIL: no OOM record")
        return False
    example = Path(__file__).resolve().parent.parent / "launch_examples" / "grpo_6gpu.yaml"
    ctx = rule_context(compose(ComposeRequest(config_files=(example,))))
    print(oom_report(record, ctx, load_fit()).render(run_dir))
    return record["status"] == "oom" and record["cuda"] is True


def on_ray(run_dir: Path) -> bool:
    """Part 3: the hook, installed by the runtime env, records CUDA memory in a verl worker holding a GPU."""
    import ray
    import torch
    from tensordict import TensorDict
    from verl.single_controller.base.worker import Worker as VerlWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class CudaRef:
        engine_config = SimpleNamespace(use_dynamic_bsz=False, infer_micro_batch_size_per_gpu=4)

        def infer_batch(self, data: Any) -> Any:
            x = torch.randn(4, SEQ, VOCAB, device="cuda", dtype=torch.bfloat16)
            data["y"] = torch.log_softmax(x.float(), dim=-1).amax(dim=(1, 2)).cpu()[: data.batch_size[0]]
            return data

    class ProbeWorker(ActorRolloutRefWorker):  # type: ignore[misc]
        def __init__(self) -> None:
            VerlWorker.__init__(self)
            self.ref = CudaRef()
            self.enable_routing_replay = False
            self._register_dispatch_collect_info(mesh_name="ref", dp_rank=self.rank, is_collect=True)

    ray_dir = run_dir / "ray-run"
    ray_dir.mkdir()
    env = {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {RUN_DIR_ENV: str(ray_dir)}}
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, runtime_env=env)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        pool = RayResourcePool([1], use_gpu=True)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(ProbeWorker)))
        group.compute_ref_log_prob(TensorDict({"x": torch.zeros(4, 1)}, batch_size=[4]))
    finally:
        ray.shutdown()
    record = json.loads((ray_dir / "memory-0.jsonl").read_text().splitlines()[-1])
    print("worker record:", json.dumps({k: record.get(k) for k in ("stage", "cuda", "peak_allocated_gib")}))
    return record["stage"] == "ref_log_prob" and record["cuda"] is True and record["peak_allocated_gib"] > 1.0


def main() -> int:
    """Run the three parts; exit 1 if any check fails."""
    import torch

    if not torch.cuda.is_available():
        print("CUDA is not available on this machine: nothing to measure (run this on a GPU machine)")
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        os.environ[RUN_DIR_ENV] = tmp
        results = {"records": in_process(run_dir), "oom": out_of_memory(run_dir), "ray": on_ray(run_dir)}
    print(json.dumps(results), f"{time.perf_counter() - start:.0f} s")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

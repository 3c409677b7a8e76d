"""Audit throughput: scripts per second over generated raw launch scripts (the `audit` verb's own path).

Usage: python bench/audit.py [N_SCRIPTS] [--profile]
Prints the time to read the scripts, to compose + audit them (the audit stage), and to run the whole
pre-flight per launch (what `verl-safe-launch audit` does), each over all N scripts after one warm-up script;
then the compose + audit rate with ``compose()`` itself instead of its fast path, the overlay, on 20 scripts.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

MODELS = [
    "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-3B-Instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen3-8B",
]
ARR = "actor_rollout_ref"


def overrides(rng: random.Random, index: int) -> list[str]:
    """One plausible GRPO/PPO override list, with the usual mistakes sprinkled in."""
    gpus = rng.choice([2, 4, 8])
    batch = rng.choice([64, 128, 256, 512, 1024])
    mini = rng.choice([b for b in (16, 32, 64, 128, 256) if b <= batch])
    adv = rng.choice(["grpo", "grpo", "gae"])
    out = [
        f"algorithm.adv_estimator={adv}",
        f"data.train_files=/data/run{index}/train.parquet",
        f"data.val_files=/data/run{index}/test.parquet",
        f"data.train_batch_size={batch}",
        f"data.max_prompt_length={rng.choice([512, 1024, 2048])}",
        f"data.max_response_length={rng.choice([512, 1024, 4096])}",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"{ARR}.model.path={rng.choice(MODELS)}",
        f"{ARR}.model.use_remove_padding=True",
        f"{ARR}.actor.optim.lr={rng.choice(['1e-6', '5e-7', '3e-6'])}",
        f"{ARR}.actor.ppo_mini_batch_size={mini}",
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu={rng.choice([2, 4, 8, 16])}",
        f"{ARR}.actor.use_kl_loss={rng.choice(['True', 'False'])}",
        f"{ARR}.actor.kl_loss_coef=0.001",
        f"{ARR}.actor.entropy_coeff=0",
        f"{ARR}.actor.fsdp_config.param_offload={rng.choice(['True', 'False'])}",
        f"{ARR}.rollout.name={rng.choice(['vllm', 'sglang'])}",
        f"{ARR}.rollout.tensor_model_parallel_size={rng.choice([1, 2, 4])}",
        f"{ARR}.rollout.gpu_memory_utilization={rng.choice([0.4, 0.5, 0.6, 0.7])}",
        f"{ARR}.rollout.n={rng.choice([1, 4, 5, 8, 16])}",
        f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu={rng.choice([4, 8, 16, 32])}",
        f"{ARR}.ref.log_prob_micro_batch_size_per_gpu={rng.choice([4, 8, 16, 32])}",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        'trainer.logger=\'["console","wandb"]\'',
        f"trainer.project_name=bench_{index % 7}",
        f"trainer.experiment_name=exp_{index}",
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        f"trainer.save_freq={rng.choice([-1, 10, 20])}",
        f"trainer.test_freq={rng.choice([5, 10])}",
        "trainer.total_epochs=15",
    ]
    if adv == "gae":
        out += [
            "critic.optim.lr=1e-5",
            f"critic.model.path={rng.choice(MODELS)}",
            "critic.use_dynamic_bsz=True",
        ]
    mistakes = [
        f"{ARR}.actor.use_kl_loss=True",
        f"trainer.n_gpus_per_node={gpus}",
        f"{ARR}.actor.ppo_micro_batch_size={mini}",
        f"{ARR}.rollout.log_prob_micro_batch_sz=8",
        "reward_model.enable=True",
        "trainer.balance_batch=False",
    ]
    out += rng.sample(mistakes, rng.choice([0, 0, 1, 2]))
    return out


def script(rng: random.Random, index: int) -> str:
    """A bash launch script in one of the layouts verl's examples use."""
    items = overrides(rng, index)
    style = index % 3
    if style == 0:
        body = " \\\n    ".join(items)
        return f'#!/bin/bash\nset -x\n\npython3 -m verl.trainer.main_ppo \\\n    {body} "$@"\n'
    if style == 1:
        head = [f"MODEL_PATH=${{MODEL_PATH:-{MODELS[index % 4]}}}", f"N_GPUS={rng.choice([4, 8])}"]
        lines = [i.replace("trainer.n_gpus_per_node=", "trainer.n_gpus_per_node=$N_GPUS #") for i in items]
        lines = [line.split(" #")[0] for line in lines]
        body = " \\\n    ".join([*lines, 'actor_rollout_ref.model.path="$MODEL_PATH"'])
        return "\n".join(
            [
                "#!/usr/bin/env bash",
                "set -euo pipefail",
                *head,
                "",
                f"python3 -u -m verl.trainer.main_ppo \\\n    {body} $@",
                "",
            ]
        )
    half = len(items) // 2
    data = "\n    ".join(items[:half])
    rest = "\n    ".join(items[half:])
    return (
        f"#!/bin/bash\nDATA=(\n    {data}\n)\nREST=(\n    {rest}\n)\n"
        'python3 -m verl.trainer.main_ppo "${DATA[@]}" "${REST[@]}" "$@"\n'
    )


def generate(directory: Path, count: int, seed: int = 0) -> list[Path]:
    """Write ``count`` scripts into ``directory``."""
    rng = random.Random(seed)
    paths = []
    for index in range(count):
        path = directory / f"run_{index:04d}.sh"
        path.write_text(script(rng, index), encoding="utf-8")
        paths.append(path)
    return paths


class Clock:
    """Wall and CPU seconds of a block (the machine may be shared: CPU time is the steadier figure)."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200
    from verl_safe_launch.audit import audit, script_findings
    from verl_safe_launch.backends import bringup_findings
    from verl_safe_launch.compose import compose
    from verl_safe_launch.preflight import Auditor
    from verl_safe_launch.shell import read_script

    with tempfile.TemporaryDirectory() as tmp:
        paths = generate(Path(tmp), count + 1)
        with Clock() as first:
            auditor = Auditor(job_findings=bringup_findings)
            warm = auditor.script(paths[0])
        assert warm.error is None, warm.error
        scripts = paths[1:]
        if "--profile" in sys.argv:
            import cProfile

            cProfile.runctx(
                "[auditor.script(p) for p in scripts]",
                globals(),
                {"auditor": auditor, "scripts": scripts},
                sort="tottime",
            )
            return
        with Clock() as read:
            launches = [launch for path in scripts for launch in read_script(path)]
        errors = 0
        with Clock() as checked:
            for launch in launches:
                composed = auditor.overlay.compose(launch.request())
                findings = [*audit(composed), *script_findings(launch)]
                errors += any(f.severity.value == "error" for f in findings)
        sample = launches[:20]
        with Clock() as slow:
            for launch in sample:
                composed = compose(launch.request())
                [*audit(composed), *script_findings(launch)]
        with Clock() as full:
            results = [auditor.script(path) for path in scripts]
    assert all(r.error is None for r in results)

    def line(label: str, wall: float, cpu: float) -> str:
        return f"{label:<30} wall {wall:6.3f} s  cpu {cpu:6.3f} s  = {count / wall:6.1f} scripts/s wall, {count / cpu:6.1f} cpu"

    print("load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(
        f"scripts: {count} ({len(launches)} launches, {errors} with audit errors); first script {first.wall:.2f} s"
    )
    print(line("read", read.wall, read.cpu))
    print(line("compose + audit", checked.wall, checked.cpu))
    print(line("read + compose + audit", read.wall + checked.wall, read.cpu + checked.cpu))
    print(line("audit verb (full pre-flight)", full.wall, full.cpu))
    rate = len(sample) / slow.wall, len(sample) / slow.cpu
    print(
        f"compose() instead of the overlay, {len(sample)} scripts: {rate[0]:.1f} scripts/s wall, {rate[1]:.1f} cpu"
    )
    print(f"fast compositions: {auditor.overlay.fast}, full compositions: {auditor.overlay.full}")


if __name__ == "__main__":
    main()

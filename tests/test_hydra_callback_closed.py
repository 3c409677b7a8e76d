"""The pre-flight callback fails closed: any error in it stops verl's real entry point before verl validates.

Hydra turns an exception raised by a callback into a warning and runs the job anyway; the callback therefore
ends the process itself. Each case runs ``python -m verl.trainer.main_ppo`` (verl's own module, executed as
``__main__`` exactly as ``-m`` does) with the callback enabled; verl's ``validate_config`` is wrapped to say
when verl got to validate. verl's modules are imported once and each case runs in a fork of that process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, make_tiny_model

from hydra_plugins.verl_safe_launch.callback import ENABLE_OVERRIDE, PreflightCallback

pytestmark = pytest.mark.slow

DRIVER = r"""
import json, os, runpy, sys
import verl.trainer.main_ppo  # verl's imports, once for every case
import verl.utils.config as config

def probe(*args, **kwargs):
    print("VERL_VALIDATES", flush=True)
    raise SystemExit(99)

config.validate_config = probe
folder, cases = sys.argv[1], json.loads(sys.argv[2])
codes = []
for index, overrides in enumerate(cases):
    pid = os.fork()
    if pid == 0:
        out = os.open(os.path.join(folder, f"{index}.out"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.argv = ["main_ppo", *overrides, f"hydra.run.dir={folder}/hydra-{index}"]
        try:
            runpy.run_module("verl.trainer.main_ppo", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = 98
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""

BAD = {
    "a word": (["+hydra.callbacks.vsl.gpus_per_node=abc"], 2, "gpus_per_node=abc is not a whole number"),
    "nan": (["+hydra.callbacks.vsl.gpus_per_node=nan"], 2, "gpus_per_node=nan is not a whole number"),
    "a list": (["+hydra.callbacks.vsl.gpus_per_node=[1,2]"], 2, "gpus_per_node=[1, 2] is not a whole number"),
    "negative": (["+hydra.callbacks.vsl.gpus_per_node=-1"], 2, "gpus_per_node=-1 is not a whole number"),
    "zero nodes": (["+hydra.callbacks.vsl.nodes=0"], 2, "nodes=0 is not a whole number"),
    "memory": (["+hydra.callbacks.vsl.gpu_memory_gb=inf"], 2, "gpu_memory_gb=inf"),
    "unknown setting": (["+hydra.callbacks.vsl.gpus=4"], 2, "unknown callback setting(s) gpus"),
    "hardware in verl's config": (
        ["+hardware.gpus_per_node=4"],
        1,
        "fix: +hydra.callbacks.vsl.gpus_per_node=4 (instead of +hardware.gpus_per_node=4)",
    ),
}


def _run(cases: list[list[str]], folder: Path) -> list[int]:
    env = {**os.environ, "VSL_HARDWARE_DETECT": "0"}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(folder), json.dumps(cases)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes: list[int] = json.loads(done.stdout.splitlines()[-1])
    return codes


def test_every_bad_callback_input_stops_verls_entry_point_before_it_validates(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny-model")
    good = [
        "+preset=small",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={model}",
        "+hydra.callbacks.vsl.gpus_per_node=2",
    ]
    cases = [[*good[:-1], *overrides, ENABLE_OVERRIDE] for overrides, _, _ in BAD.values()]
    cases.append([*good, ENABLE_OVERRIDE])  # the control: a clean pre-flight lets verl validate
    codes = _run(cases, tmp_path)
    outputs = [(tmp_path / f"{i}.out").read_text() for i in range(len(cases))]
    assert codes[-1] == 99 and "VERL_VALIDATES" in outputs[-1], outputs[-1][-3000:]
    for (name, (_, code, message)), got, output in zip(BAD.items(), codes, outputs, strict=False):
        assert (got, "VERL_VALIDATES" in output) == (code, False), f"{name}: {output[-3000:]}"
        assert message in output, f"{name}: {output[-3000:]}"
        assert "Traceback" not in output and "UserWarning: Callback" not in output, name
        assert output.count("verl-safe-launch pre-flight (inside verl's entry point") == 1, name


def test_a_failure_of_the_callback_itself_stops_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug of ours is not a warning either: exit 4, with one line saying the job was stopped."""
    from omegaconf import OmegaConf

    callback = PreflightCallback()
    config = OmegaConf.create({"hydra": {"job": {"config_name": "ppo_trainer"}, "overrides": {"task": []}}})
    monkeypatch.setattr("hydra_plugins.verl_safe_launch.callback.preflight_report", _broken)
    with pytest.raises(SystemExit) as stopped:
        callback.on_job_start(config, task_function=None)
    assert stopped.value.code == 4


def _broken(*args: object) -> tuple[int, str]:
    raise ZeroDivisionError("a bug")

"""Worker-side memory hooks: records per call, nesting, OOM and errors, async methods, patching verl's classes.

No GPU here: records are checked in their CPU form (``cuda: false`` with the note); the CUDA branch runs in
``bench/gpu_launch_smoke.py`` on a GPU machine.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from verl_safe_launch.launch import (
    NO_CUDA_NOTE,
    RUN_DIR_ENV,
    STAGE_BY_NAME,
    WORKERS_FILE,
    hooks,
    install,
    patch_module,
    wrap_stage,
)

ACTOR_UPDATE = STAGE_BY_NAME["actor_update"]
ARR = "actor_rollout_ref"


class FakeWorker:
    """Stands in for ActorRolloutRefWorker: an inner actor with an engine config, and a rank."""

    def __init__(self, rank: int = 0, dynamic: bool = False) -> None:
        self.rank = rank
        engine = SimpleNamespace(
            use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=4, max_token_len_per_gpu=8192
        )
        self.actor = SimpleNamespace(engine_config=engine)
        self.inner_calls = 0

    def update_actor(self, data: object) -> str:
        return "updated"

    def nested(self, data: object) -> str:
        return self.update_actor(data)

    def fails(self, data: object) -> None:
        raise RuntimeError("boom\nsecond line")

    def runs_out(self, data: object) -> None:
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    async def update_weights(self, global_steps: int | None = None) -> str:
        await asyncio.sleep(0)
        return "synced"


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("memory-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(hooks, "_STATE", {"step": None, "calls": {}})
    return tmp_path


def test_a_call_writes_one_record_with_settings_and_the_cpu_note(run_dir: Path) -> None:
    worker = FakeWorker(rank=3)
    wrapped = wrap_stage(FakeWorker.update_actor, ACTOR_UPDATE)
    assert wrapped(worker, {}) == "updated"
    (record,) = _records(run_dir)
    assert (run_dir / "memory-3.jsonl").is_file()
    assert record["stage"] == "actor_update"
    assert record["rank"] == 3
    assert record["status"] == "ok"
    assert record["call"] == 1
    assert record["settings"] == {
        f"{ARR}.actor.use_dynamic_bsz": False,
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu": 4,
        f"{ARR}.actor.ppo_max_token_len_per_gpu": 8192,
    }
    assert record["knobs"] == [f"{ARR}.actor.ppo_micro_batch_size_per_gpu"]
    assert record["cuda"] is False
    assert record["note"] == NO_CUDA_NOTE
    assert record["duration_s"] >= 0
    assert "peak_allocated_gib" not in record


@pytest.mark.parametrize(
    ("dynamic", "knob"),
    [(False, f"{ARR}.actor.ppo_micro_batch_size_per_gpu"), (True, f"{ARR}.actor.ppo_max_token_len_per_gpu")],
)
def test_the_knob_in_force_follows_dynamic_batching(run_dir: Path, dynamic: bool, knob: str) -> None:
    wrap_stage(FakeWorker.update_actor, ACTOR_UPDATE)(FakeWorker(dynamic=dynamic), {})
    assert _records(run_dir)[0]["knobs"] == [knob]


def test_a_wrapped_call_inside_another_is_not_recorded_twice(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FakeWorker, "update_actor", wrap_stage(FakeWorker.update_actor, ACTOR_UPDATE))
    outer = wrap_stage(FakeWorker.nested, STAGE_BY_NAME["old_log_prob"])
    assert outer(FakeWorker(), {}) == "updated"
    assert [r["stage"] for r in _records(run_dir)] == ["old_log_prob"]


def test_out_of_memory_is_recorded_with_stage_and_settings_then_raised(run_dir: Path) -> None:
    import torch

    with pytest.raises(torch.OutOfMemoryError):
        wrap_stage(FakeWorker.runs_out, ACTOR_UPDATE)(FakeWorker(rank=1), {})
    (record,) = _records(run_dir)
    assert record["status"] == "oom"
    assert record["stage"] == "actor_update"
    assert record["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert record["settings"][f"{ARR}.actor.ppo_micro_batch_size_per_gpu"] == 4


def test_other_errors_are_recorded_as_errors_with_their_first_line(run_dir: Path) -> None:
    with pytest.raises(RuntimeError):
        wrap_stage(FakeWorker.fails, ACTOR_UPDATE)(FakeWorker(), {})
    (record,) = _records(run_dir)
    assert (record["status"], record["error"]) == ("error", "RuntimeError: boom")


def test_async_methods_stay_coroutines_and_take_the_step_from_global_steps(run_dir: Path) -> None:
    wrapped = wrap_stage(FakeWorker.update_weights, STAGE_BY_NAME["weight_sync"])
    assert inspect.iscoroutinefunction(wrapped)
    assert asyncio.run(wrapped(FakeWorker(), global_steps=7)) == "synced"
    wrap_stage(FakeWorker.update_actor, ACTOR_UPDATE)(FakeWorker(), {})
    first, second = _records(run_dir)
    assert (first["stage"], first["step"]) == ("weight_sync", 7)
    assert (second["stage"], second["step"]) == ("actor_update", 7)


def test_records_are_strict_json(run_dir: Path) -> None:
    hooks.append_record(
        {"rank": 0, "stage": "actor_update", "peak_allocated_gib": float("nan"), "x": float("inf")}
    )
    [line] = (run_dir / "memory-0.jsonl").read_text().splitlines()
    record = json.loads(line, parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}"))
    assert (record["peak_allocated_gib"], record["x"], record["stage"]) == (None, None, "actor_update")


def test_without_a_run_directory_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    wrap_stage(FakeWorker.update_actor, ACTOR_UPDATE)(FakeWorker(), {})
    assert not list(tmp_path.iterdir())


def test_install_is_inert_without_the_run_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = list(sys.meta_path)
    install()
    assert sys.meta_path == before


def test_install_patches_the_workers_module_when_it_is_imported_later(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg_src"
    package.mkdir()
    (package / "fake_engine_workers.py").write_text(
        "class ActorRolloutRefWorker:\n    def update_actor(self, data):\n        return 'real'\n"
    )
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(hooks, "WORKERS_MODULE", "fake_engine_workers")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "fake_engine_workers", raising=False)
    install()
    import fake_engine_workers

    worker = fake_engine_workers.ActorRolloutRefWorker()
    assert worker.update_actor({}) == "real"
    assert fake_engine_workers.ActorRolloutRefWorker.update_actor.__wrapped__ is not None
    assert [r["stage"] for r in _records(run_dir)] == ["actor_update"]
    setup, patched = (json.loads(line) for line in (run_dir / WORKERS_FILE).read_text().splitlines())
    assert (setup["event"], setup["pid"]) == ("setup", os.getpid())
    assert (patched["event"], patched["patched"]) == ("patched", ["ActorRolloutRefWorker.update_actor"])
    if hooks._cuda() is None:  # this process sees no CUDA device
        assert (patched["cuda"], patched["note"]) == (False, NO_CUDA_NOTE)
    sys.modules.pop("fake_engine_workers", None)


@pytest.mark.slow
def test_patching_verls_worker_classes_keeps_dispatch_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers import engine_workers

    originals = {}
    for spec in hooks.STAGES:
        cls = getattr(engine_workers, spec.cls)
        originals[(spec.cls, spec.method)] = cls.__dict__[spec.method]
        monkeypatch.setattr(cls, spec.method, cls.__dict__[spec.method])
    patched = patch_module(engine_workers)
    assert sorted(patched) == sorted(f"{s.cls}.{s.method}" for s in hooks.STAGES)
    assert patch_module(engine_workers) == []
    for (cls_name, method), original in originals.items():
        now = getattr(engine_workers, cls_name).__dict__[method]
        assert now.__wrapped__ is original
        assert getattr(now, MAGIC_ATTR) == getattr(original, MAGIC_ATTR)
        assert inspect.iscoroutinefunction(now) == inspect.iscoroutinefunction(original)

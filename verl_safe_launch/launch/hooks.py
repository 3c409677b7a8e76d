"""Worker-side memory logging: wrap verl's worker stages, one JSON line per call in the run directory."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from verl_safe_launch.launch.hook_stages import STAGES, StageSpec
from verl_safe_launch.render import strict_json

RUN_DIR_ENV = "VSL_RUN_DIR"
USER_SETUP_HOOK_ENV = "VSL_USER_SETUP_HOOK"
SETUP_HOOK = "verl_safe_launch.launch.hooks.install"
WORKERS_MODULE = "verl.workers.engine_workers"
NO_CUDA_NOTE = "no CUDA device in this process: torch and device memory not recorded"
# One line per Ray worker process the setup hook ran in ("setup"), and per process whose verl worker classes it
# wrapped ("patched", with the CUDA devices that process saw).
WORKERS_FILE = "workers.jsonl"
_PATCHED_ATTR = "__vsl_memory_hook__"
_GIB = float(1 << 30)

# The stage running in this context. A wrapped call inside another (update_actor -> train_batch) is not
# recorded separately: the outer stage's peak covers it.
_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("vsl_active_stage", default=None)
_STATE: dict[str, Any] = {"step": None, "calls": {}}
_FDS: dict[str, int] = {}
_HOST = socket.gethostname()


def install() -> None:
    """Ray ``worker_process_setup_hook``: patch verl's worker classes in this process, now or when imported.

    Inert unless the launcher set ``VSL_RUN_DIR``; runs a user's own setup hook (``VSL_USER_SETUP_HOOK``) too.
    """
    user_hook = os.environ.get(USER_SETUP_HOOK_ENV)
    if user_hook:
        _call_fqn(user_hook)
    if not os.environ.get(RUN_DIR_ENV):
        return
    _record_worker({"event": "setup"})
    module = sys.modules.get(WORKERS_MODULE)
    if module is not None:
        _patch_and_record(module)
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _call_fqn(fqn: str) -> None:
    import importlib

    module_name, _, attr = fqn.rpartition(".")
    getattr(importlib.import_module(module_name), attr)()


def patch_module(module: ModuleType, stages: Sequence[StageSpec] = STAGES) -> list[str]:
    """Wrap the listed methods of ``module``'s classes (idempotent); return the ``Class.method`` patched."""
    patched: list[str] = []
    for spec in stages:
        cls = getattr(module, spec.cls, None)
        fn = cls.__dict__.get(spec.method) if isinstance(cls, type) else None
        if fn is None or getattr(fn, _PATCHED_ATTR, False):
            continue
        setattr(cls, spec.method, wrap_stage(fn, spec))
        patched.append(f"{spec.cls}.{spec.method}")
    return patched


def _patch_and_record(module: ModuleType) -> None:
    """Patch verl's worker module in this process and note it, with the CUDA devices this process sees."""
    patched = patch_module(module)
    _record_worker({"event": "patched", "patched": patched, **_devices()})


def _devices() -> dict[str, object]:
    cuda = _cuda()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda is None:
        return {"cuda": False, "cuda_visible_devices": visible, "note": NO_CUDA_NOTE}
    return {"cuda": True, "cuda_visible_devices": visible, "device_count": int(cuda.device_count())}


def _record_worker(event: dict[str, object]) -> None:
    """Append this process's line to ``workers.jsonl``; never raises (a hook must not break a worker)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    record = {**event, "pid": os.getpid(), "host": _HOST, "time": round(time.time(), 3)}
    try:
        if run_dir:
            _append_line(str(Path(run_dir) / WORKERS_FILE), record)
    except OSError as err:
        print(f"verl-safe-launch hook: could not write {WORKERS_FILE}: {err}", file=sys.stderr)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch_and_record(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches verl's worker module when (and only if) the process imports it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != WORKERS_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def wrap_stage(fn: Callable[..., Any], spec: StageSpec) -> Callable[..., Any]:
    """Wrap a worker method: each outermost call appends a record; verl's dispatch metadata survives."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _ACTIVE.get() is not None:
                return await fn(self, *args, **kwargs)
            with _recording(self, spec, args, kwargs):
                return await fn(self, *args, **kwargs)

        setattr(async_wrapper, _PATCHED_ATTR, True)
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get() is not None:
            return fn(self, *args, **kwargs)
        with _recording(self, spec, args, kwargs):
            return fn(self, *args, **kwargs)

    setattr(wrapper, _PATCHED_ATTR, True)
    return wrapper


@contextlib.contextmanager
def _recording(self: Any, spec: StageSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """One outermost stage call: mark it active, then append its record (with the error, if it raised)."""
    call = _begin(self, spec, args, kwargs)
    token = _ACTIVE.set(spec.stage)
    try:
        yield
    except BaseException as exc:
        _finish(call, exc)
        raise
    finally:
        _ACTIVE.reset(token)
    _finish(call, None)


@dataclass
class _Call:
    spec: StageSpec
    rank: int | None
    step: int | None
    index: int
    settings: dict[str, object]
    cuda: Any
    started: float


def _begin(worker: Any, spec: StageSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    step = _step_from(spec, args, kwargs)
    if step is not None:
        _STATE["step"] = step
    calls: dict[str, int] = _STATE["calls"]
    calls[spec.stage] = calls.get(spec.stage, 0) + 1
    settings = {s.key: _dig(worker, s.path) for s in spec.settings}
    cuda = _cuda()
    if cuda is not None:
        try:
            cuda.reset_peak_memory_stats()
        except Exception:
            cuda = None
    rank = getattr(worker, "rank", None)
    rank = rank if isinstance(rank, int) else _env_int("RANK")
    return _Call(spec, rank, _STATE["step"], calls[spec.stage], settings, cuda, time.perf_counter())


def _step_from(spec: StageSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    if spec.stage == "weight_sync":
        value = kwargs.get("global_steps", args[0] if args else None)
        return value if isinstance(value, int) else None
    data = args[0] if args else kwargs.get("data")
    getter = getattr(data, "get_non_tensor", None)
    if getter is None:
        return None
    try:
        value = getter("global_steps", None)
    except Exception:
        return None
    return value if isinstance(value, int) else None


def _dig(obj: Any, path: str) -> object:
    """Follow a dotted attribute path; None where any part is missing; plain values only."""
    for part in path.split("."):
        if obj is None:
            return None
        try:
            obj = getattr(obj, part)
        except Exception:
            return None
    return obj if isinstance(obj, bool | int | float | str) or obj is None else str(obj)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _cuda() -> Any:
    """``torch.cuda`` when this process has a CUDA device, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:
        return None


def _finish(call: _Call, exc: BaseException | None) -> None:
    try:
        record = build_record(call, exc)
        append_record(record)
    except Exception as err:  # logging must never break training
        print(f"verl-safe-launch memory hook: could not record {call.spec.stage}: {err}", file=sys.stderr)


def build_record(call: _Call, exc: BaseException | None) -> dict[str, object]:
    """The JSON record of one finished (or failed) call."""
    record: dict[str, object] = {
        "stage": call.spec.stage,
        "step": call.step,
        "call": call.index,
        "rank": call.rank,
        "pid": os.getpid(),
        "host": _HOST,
        "status": _status(exc),
        "settings": call.settings,
        "knobs": list(call.spec.knobs(call.settings)),
        "duration_s": round(time.perf_counter() - call.started, 6),
        "time": round(time.time(), 3),
    }
    record.update(_memory(call.cuda))
    if exc is not None:
        record["error"] = f"{type(exc).__name__}: {_first_line(exc)}"
    return record


def _status(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    return "oom" if is_oom(exc) else "error"


def is_oom(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and any error whose message says the device ran out of memory."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _memory(cuda: Any) -> dict[str, object]:
    out: dict[str, object] = {"cpu_max_rss_gib": _max_rss_gib()}
    if cuda is None:
        out.update(cuda=False, note=NO_CUDA_NOTE)
        return out
    free, total = cuda.mem_get_info()
    out.update(
        cuda=True,
        device=cuda.current_device(),
        allocated_gib=_gib(cuda.memory_allocated()),
        reserved_gib=_gib(cuda.memory_reserved()),
        peak_allocated_gib=_gib(cuda.max_memory_allocated()),
        peak_reserved_gib=_gib(cuda.max_memory_reserved()),
        device_used_gib=_gib(total - free),
        device_total_gib=_gib(total),
    )
    return out


def _gib(num_bytes: int) -> float:
    return round(num_bytes / _GIB, 4)


def _max_rss_gib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB, 4)


def record_path(run_dir: Path, rank: int | None) -> Path:
    """``memory-<rank>.jsonl`` in the run directory (``memory-pid<PID>.jsonl`` when the rank is unknown)."""
    name = f"memory-{rank}.jsonl" if rank is not None else f"memory-pid{os.getpid()}.jsonl"
    return run_dir / name


def append_record(record: dict[str, object]) -> None:
    """Append one JSON line in a single write (appends from several processes do not interleave)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    rank = record.get("rank")
    path = record_path(Path(run_dir), rank if isinstance(rank, int) else None)
    _append_line(str(path), record)


def _append_line(path: str, record: dict[str, object]) -> None:
    line = json.dumps(strict_json(record), default=str, allow_nan=False)
    os.write(_append_fd(path), (line + "\n").encode())


def _append_fd(path: str) -> int:
    """One append-mode descriptor per record file, kept open for the life of the process."""
    fd = _FDS.get(path)
    if fd is None:
        fd = _FDS[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return fd

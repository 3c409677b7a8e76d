"""After a run: which stage ran out of memory and what to paste, or estimated vs measured peak per stage."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.config_view import format_value
from verl_safe_launch.context import RuleContext
from verl_safe_launch.doctor.oom_log import read_lines
from verl_safe_launch.errors import InputError, LaunchError, VslError
from verl_safe_launch.launch import STAGE_BY_NAME
from verl_safe_launch.render import Column, render_table

MARGIN = 0.10
NO_CUDA_FIX = (
    "the failing worker saw no CUDA device: run on a machine with GPUs "
    "(memory-*.jsonl and workers.jsonl in the run directory say what each worker saw)"
)
UTIL_STEP = 0.1
UTIL_FLOOR = 0.1
NO_FIT = (
    "the memory estimator is not available (verl_safe_launch.fit could not be imported): "
    "halving the knob instead of fitting it"
)
# Hook stage -> the estimator's stage (verl_safe_launch.memory).
PEAK_COLUMNS = (
    Column("stage", min_width=15),
    Column("estimated GiB", "right"),
    Column("torch peak GiB", "right"),
    Column("device used GiB", "right"),
)
ESTIMATOR_STAGE = {
    "old_log_prob": "old log-prob",
    "ref_log_prob": "ref log-prob",
    "actor_update": "actor update",
    "weight_sync": "rollout",
    "critic_update": "critic",
    "critic_values": "critic",
}


@dataclass(frozen=True)
class KnobAdvice:
    """One knob of the stage that ran out: its current value, the value to use and why."""

    key: str
    current: object
    value: object
    reason: str
    override: str


@dataclass(frozen=True)
class OomReport:
    """The out-of-memory post-mortem: stage, record, knobs to change and the line to paste."""

    stage: str
    record: Mapping[str, Any]
    advice: tuple[KnobAdvice, ...]
    notes: tuple[str, ...]
    override: str

    def render(self, run_dir: Path) -> str:
        """The report printed by ``run`` (exit 3)."""
        rec = self.record
        spec = STAGE_BY_NAME.get(self.stage)
        method = f" ({spec.cls}.{spec.method})" if spec else ""
        step = f", step {rec['step']}" if rec.get("step") is not None else ""
        lines = [
            f"error: out of memory in stage {self.stage}{method}, rank {rec.get('rank')}{step}",
            f"  cause: {rec.get('error')}",
            f"  settings in force: {_settings(rec.get('settings'))}",
        ]
        if rec.get("cuda"):
            lines.append(
                f"  device: {rec.get('device_used_gib')} of {rec.get('device_total_gib')} GiB used, "
                f"torch peak {rec.get('peak_allocated_gib')} GiB allocated"
            )
        for item in self.advice:
            lines.append(
                f"  knob: {item.key} = {format_value(item.current)} -> {format_value(item.value)} ({item.reason})"
            )
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(
            f"  paste: {self.override}" if self.override else "  paste: (no knob to change was found)"
        )
        lines.append(f"  run directory: {run_dir}")
        return "\n".join(lines)


def _settings(settings: object) -> str:
    if not isinstance(settings, Mapping) or not settings:
        return "(none recorded)"
    return ", ".join(f"{key}={format_value(value)}" for key, value in settings.items())


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every memory record of the run (all ranks), oldest first; unreadable lines are skipped.

    The files are streamed line by line (a line longer than 64 KiB is no record)."""
    records: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("memory-*.jsonl")):
        try:
            records.extend(_records(path))
        except InputError:  # a FIFO or a device where a record file should be: not a record
            continue
    return sorted(records, key=_time)


RECORDS_LIMIT = 64 * 1024 * 1024
"""Bytes of one memory-*.jsonl read (a record is a few hundred bytes; a run writes a few per stage call)."""


def _records(path: Path) -> Iterator[dict[str, Any]]:
    for line in read_lines(path, RECORDS_LIMIT):
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: a line nested thousands deep
            continue
        if isinstance(item, dict) and "stage" in item:
            yield item


def _time(record: Mapping[str, Any]) -> float:
    value = record.get("time")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def first_oom(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The earliest out-of-memory record, if any."""
    return next((r for r in records if r.get("status") == "oom"), None)


def first_failure(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The earliest record of a stage call that raised (out of memory or any other error)."""
    return next((r for r in records if r.get("status") in ("error", "oom")), None)


def failure_report(failure: VslError, record: Mapping[str, Any] | None, run_dir: Path) -> VslError:
    """The launch error with the post-mortem's stage (from the failing worker's record) and a fix for it."""
    if record is None:
        return failure
    stage = str(record.get("stage"))
    spec = STAGE_BY_NAME.get(stage)
    method = f" ({spec.cls}.{spec.method})" if spec else ""
    cuda = bool(record.get("cuda"))
    device = f"CUDA device {record.get('device')}" if cuda else "no CUDA device"
    where = (
        f"stage {stage}{method}, rank {record.get('rank')}, pid {record.get('pid')} on {record.get('host')} "
        f"({device}); run directory {run_dir}"
    )
    fix = failure.fix if cuda else NO_CUDA_FIX
    return LaunchError(failure.what, where=where, fix=fix)


FitFn = Callable[..., Any]


def load_fit() -> FitFn | None:
    """The estimator's ``fit_knobs``, or None when that module is not available."""
    try:
        module = importlib.import_module("verl_safe_launch.memory.fit")
    except ImportError:
        return None
    fit: FitFn | None = getattr(module, "fit_knobs", None)
    return fit


def oom_report(record: Mapping[str, Any], ctx: RuleContext, fit: FitFn | None) -> OomReport:
    """Which knobs drive the stage that ran out, the values to use instead, and the override to paste."""
    stage = str(record.get("stage"))
    settings: Mapping[str, Any] = record.get("settings") or {}
    knobs = [k for k in record.get("knobs") or () if isinstance(k, str)]
    notes: list[str] = []
    fitted = _fitted(knobs, settings, record, ctx, fit, notes)
    found = (fitted.get(key) or _fallback(key, settings.get(key), fit is None, ctx) for key in knobs)
    advice = tuple(a for a in found if a is not None)
    override = " ".join(a.override for a in advice)
    return OomReport(stage, dict(record), advice, tuple(notes), override)


def _fitted(
    knobs: Sequence[str],
    settings: Mapping[str, Any],
    record: Mapping[str, Any],
    ctx: RuleContext,
    fit: FitFn | None,
    notes: list[str],
) -> dict[str, KnobAdvice]:
    ints = {
        k: settings[k]
        for k in knobs
        if isinstance(settings.get(k), int) and not isinstance(settings[k], bool)
    }
    if not ints:
        return {}
    if fit is None:
        notes.append(NO_FIT)
        return {}
    cap = {key: max(1, value - 1) for key, value in ints.items()}
    try:
        fits = fit(_with_measured_memory(ctx, record), margin=MARGIN, cap=cap)
    except Exception as exc:
        notes.append(f"the memory estimator failed ({type(exc).__name__}: {exc}); halving the knob instead")
        return {}
    out: dict[str, KnobAdvice] = {}
    for item in fits:
        if item.key in ints and item.value is None:
            notes.append(f"{item.key}: nothing fitted ({item.reason})")
        elif item.key in ints:
            out[item.key] = KnobAdvice(item.key, ints[item.key], item.value, item.reason, str(item.override))
    return out


def _with_measured_memory(ctx: RuleContext, record: Mapping[str, Any]) -> RuleContext:
    """Plan against the GPU memory the failing worker saw when the pre-flight did not know it."""
    total = record.get("device_total_gib")
    if ctx.hardware.gpu_memory_gb is not None or not isinstance(total, int | float):
        return ctx
    hardware = dataclasses.replace(ctx.hardware, gpu_memory_gb=round(float(total), 1))  # GiB, as nvidia-smi
    return dataclasses.replace(ctx, hardware=hardware)


def _fallback(key: str, current: object, no_fit: bool, ctx: RuleContext) -> KnobAdvice | None:
    """Advice without a fitted value: turn offload on, lower the rollout memory fraction, halve a batch knob."""
    if isinstance(current, bool):
        return None if current else _advice(key, current, True, "keep these weights in CPU memory", ctx)
    if isinstance(current, float) and key.endswith("gpu_memory_utilization"):
        value = round(max(UTIL_FLOOR, current - UTIL_STEP), 2)
        return _advice(key, current, value, "leave more device memory to the training engine", ctx)
    if isinstance(current, int) and current > 1:
        return _advice(key, current, current // 2, "halved" if no_fit else "halved: nothing fitted", ctx)
    return None


def _advice(key: str, current: object, value: object, reason: str, ctx: RuleContext) -> KnobAdvice:
    prefix = "" if key in ctx.view else "+"
    return KnobAdvice(key, current, value, reason, f"{prefix}{key}={format_value(value)}")


def measured_peaks(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stage: the highest torch peak and device use any rank recorded."""
    peaks: dict[str, dict[str, float]] = {}
    for rec in records:
        if not rec.get("cuda"):
            continue
        entry = peaks.setdefault(str(rec["stage"]), {"peak_allocated_gib": 0.0, "device_used_gib": 0.0})
        for key in entry:
            value = rec.get(key)
            if isinstance(value, int | float):
                entry[key] = max(entry[key], float(value))
    return peaks


def render_peaks(records: Sequence[Mapping[str, Any]], estimated: Mapping[str, float] | None) -> str:
    """Estimated vs measured peak per stage, as a small table."""
    measured = measured_peaks(records)
    if not records:
        return "memory: no records were written (the workers never reached a wrapped stage)"
    if not measured:
        return "memory: records were written without CUDA (no device memory to compare)"
    rows = []
    for stage, entry in measured.items():
        est = (estimated or {}).get(ESTIMATOR_STAGE.get(stage, stage))
        shown = f"{est:.1f}" if est is not None else "-"
        rows.append((stage, shown, f"{entry['peak_allocated_gib']:.1f}", f"{entry['device_used_gib']:.1f}"))
    return render_table(PEAK_COLUMNS, rows, gap=1).rstrip("\n")


def estimated_peaks(ctx: RuleContext) -> dict[str, float] | None:
    """The estimator's peak per stage, or None when the estimator is not available or cannot tell."""
    try:
        from verl_safe_launch.memory import estimate_memory

        estimate = estimate_memory(ctx)
    except Exception:
        return None
    return {stage.name: stage.total for stage in estimate.stages} or None

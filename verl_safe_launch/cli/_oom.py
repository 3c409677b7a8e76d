"""``oom``: read a failed run's log, name the stage and knob that ran out, and rank the fixes by memory freed."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_safe_launch.cli._common import add_compose_args, make_parser, parse, print_json
from verl_safe_launch.compose import require_accepted
from verl_safe_launch.doctor import (
    MAX_EVENTS,
    OomEvent,
    diagnose,
    diagnose_log_only,
    diagnosis_json,
    find_ooms,
    first_oom,
    read_records,
    render_diagnosis,
)
from verl_safe_launch.errors import EXIT_OK, InputError
from verl_safe_launch.inputs import request_from_args
from verl_safe_launch.preflight import rule_context
from verl_safe_launch.presets import compose_for_launch

EXAMPLES = """\
  verl-safe-launch oom ray_job.log -c run.yaml
  verl-safe-launch oom outputs/2026-07-01/12-00-00 hardware.gpu_memory_gb=80
  verl-safe-launch oom worker-0.err -c run.yaml actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct --format json

PATH is a verl or Ray log, or a run directory (its memory-*.jsonl records and every *.log/*.out/*.err under it).
Pass the run's config (-c FILE and the same overrides) so the checklist starts from the values that failed.
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``oom``."""
    parser = make_parser(
        "oom",
        "Find the CUDA out-of-memory error (or the rollout engine's KV-cache or wake-up failure, Ray's host-memory "
        "kill) in a log, name the stage and the knob that drives it, and print the fixes as overrides ranked by "
        "how much memory each frees (or the fix outside the run, when another process fills the GPU).",
        EXAMPLES,
    )
    parser.add_argument("path", metavar="PATH", help="a verl/Ray log file or a run directory")
    add_compose_args(parser)
    ns = parse(parser, args)
    path = Path(ns.path)
    if not path.exists():
        raise InputError(f"no such log or run directory: {path}", where="PATH", fix="pass the run's log file")
    events = find_ooms(path)
    records = read_records(path) if path.is_dir() else []
    record = first_oom(records)
    if not events and record is not None:
        events = [from_record(record)]
    if not events:
        raise InputError(
            f"no out-of-memory error found in {path}",
            where="PATH",
            fix="pass the log that holds torch's 'CUDA out of memory' message or vLLM/SGLang's KV-cache error",
        )
    note = _config_note(ns, path)
    if note is None and not ns.config and not ns.overrides:
        result = diagnose_log_only(events[0], record)  # nothing tells the values that failed
    else:
        request = request_from_args(_without_path(ns), args, offset)
        ctx = rule_context(require_accepted(compose_for_launch(request)))
        result = diagnose(events[0], ctx, record)
    if note:
        result = dataclasses.replace(result, notes=(note, *result.notes))
    if ns.format == "json":
        print_json({**diagnosis_json(result), "errors_found": len(events)})
    else:
        count = f"{len(events) - 1}{'+' if len(events) == MAX_EVENTS else ''}"
        more = f"({count} more out-of-memory errors in the logs)\n" if len(events) > 1 else ""
        print(render_diagnosis(result) + more, end="")
    return EXIT_OK


def from_record(record: Mapping[str, Any]) -> OomEvent:
    """An event from the memory hook's out-of-memory record (a run directory without the worker's log)."""
    total = record.get("device_total_gib")
    return OomEvent(
        "memory-*.jsonl",
        str(record.get("error") or "out of memory"),
        "record",
        str(record.get("stage")),
        None,
        total_gib=float(total) if isinstance(total, int | float) else None,
    )


def _config_note(ns: argparse.Namespace, path: Path) -> str | None:
    """Use a run directory's own config.yaml when no -c was given; say when the checklist starts from defaults."""
    if ns.config:
        return None
    saved = path / "config.yaml" if path.is_dir() else None
    if saved is not None and saved.is_file():
        ns.config = [str(saved)]
        return f"config: {saved} (the run's resolved config)"
    if ns.overrides:
        return "no config given (-c FILE with the run's config): the checklist starts from verl's defaults"
    return None


def _without_path(ns: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{k: v for k, v in vars(ns).items() if k != "path"})

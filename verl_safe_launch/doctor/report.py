"""The report of ``oom``: the text checklist, and the stable JSON form."""

from __future__ import annotations

from typing import Any

from verl_safe_launch.config_view import format_value
from verl_safe_launch.doctor.oom_doctor import Diagnosis, Remedy, entropy_key
from verl_safe_launch.doctor.oom_log import HOST, KV_CACHE, WAKE_UP
from verl_safe_launch.render import escape

UNSIZED = -1.0
"""``freed_gib`` of a checklist item that what was given cannot size (the log alone, without the config)."""


def render_diagnosis(d: Diagnosis) -> str:
    """The text report of ``oom``."""
    e = d.event
    where = f" ({e.method})" if e.method else ""
    lines = [f"out of memory in stage {d.stage or e.stage or 'unknown'}{where} at {e.where}"]
    if e.kind == KV_CACHE:
        lines[0] += " (the rollout engine's KV cache)"
    elif e.kind == WAKE_UP:
        lines[0] += " (the rollout engine waking up)"
    elif e.kind == HOST:
        lines[0] += " (host memory)"
    if e.kind == "torch":
        lines.append(
            f"  torch: tried to allocate {e.tried_gib:g} GiB on GPU {e.gpu}; {e.total_gib:g} GiB total, "
            f"{e.free_gib:g} GiB free"
            + (f", this process {e.in_use_gib:g} GiB in use" if e.in_use_gib else "")
            + "".join(f", process {pid} {gib:g} GiB" for pid, gib in e.others_gib)
        )
        if e.in_entropy:
            lines.append("  in verl's entropy_from_logits: the entropy over the full-vocabulary logits")
    else:
        lines.append(f"  {e.detail}")
        lines.append(f"  log: {e.line[-200:]}")
    if d.knob and not d.pastable and d.knob_value is None:
        lines.append(f"  knob: {d.knob} (its value is in the run's config)")
    elif d.knob:
        lines.append(f"  knob: {d.knob} = {format_value(d.knob_value)}")
    lines += [f"  note: {n}" for n in d.notes]
    if d.fix:
        lines.append(f"fix: {d.fix}")
    if d.remedies:
        order = {KV_CACHE: "in order", WAKE_UP: "in order", HOST: "host memory freed first"}
        order_text = order.get(
            e.kind, "the entropy's own switches first" if e.in_entropy else "most memory freed first"
        )
        lines.append(f"checklist ({order_text}; the stage's estimated peak after each change):")
        for i, r in enumerate(d.remedies, 1):
            lines.append(f"  {i}. {' '.join(r.overrides)}")
            lines.append(f"     {_effect(r)}: {r.why}")
        if d.pastable:
            lines.append(f"paste: {' '.join(paste(d).overrides)}")
    return "\n".join(escape(line) for line in lines) + "\n"  # the log's own text is never printed raw


def _effect(r: Remedy) -> str:
    if r.freed_gib == UNSIZED:
        return "frees what the model and config decide"
    effect = f"frees ~{r.freed_gib:.1f} GiB" if r.freed_gib >= 0 else f"uses ~{-r.freed_gib:.1f} GiB more"
    return f"{effect}, peak ~{r.peak_gib:.1f} GiB"


def paste(d: Diagnosis) -> Remedy:
    """The remedy to paste: the entropy's switch when the failure is in the entropy, else the stage's own knob
    when it has one (nothing else about the run changes)."""
    if d.event.in_entropy and any(entropy_key(r.overrides[0]) for r in d.remedies):
        return d.remedies[0]
    own = [r for r in d.remedies if d.knob and r.overrides[0].lstrip("+").startswith(d.knob + "=")]
    return own[0] if own else d.remedies[0]


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """The stable JSON form of ``oom``."""
    e = d.event
    return {
        "where": e.where,
        "kind": e.kind,
        "stage": d.stage,
        "method": e.method,
        "torch": {
            "tried_gib": e.tried_gib,
            "gpu": e.gpu,
            "total_gib": e.total_gib,
            "free_gib": e.free_gib,
            "in_use_gib": e.in_use_gib,
        },
        "knob": d.knob,
        "knob_value": d.knob_value,
        "estimated_gib": None if d.estimated_gib is None else round(d.estimated_gib, 3),
        "scale": round(d.scale, 3),
        "remedies": [
            {
                "overrides": list(r.overrides),
                "freed_gib": None if r.freed_gib == UNSIZED else round(r.freed_gib, 3),
                "peak_gib": None if r.freed_gib == UNSIZED else round(r.peak_gib, 3),
            }
            | {"why": r.why}
            for r in d.remedies
        ],
        "notes": list(d.notes),
        "fix": d.fix or None,
        "in_entropy": e.in_entropy,
        "other_processes": [{"pid": pid, "gib": gib} for pid, gib in e.others_gib],
        "paste": list(paste(d).overrides) if d.remedies and d.pastable else [],
    }

"""``estimate``: per-stage GPU memory per component; ``--fit`` finds the largest micro batches that fit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_safe_launch.cli._common import add_compose_args, make_parser, parse, print_json
from verl_safe_launch.compose import require_accepted
from verl_safe_launch.context import RuleContext
from verl_safe_launch.errors import EXIT_OK, InputError, UsageError
from verl_safe_launch.inputs import request_from_args
from verl_safe_launch.memory import (
    COMPONENTS,
    DEFAULT_OVERHEAD_GIB,
    KnobFit,
    MemoryEstimate,
    StageEstimate,
    estimate_memory,
    fit_knobs,
    fit_notes,
    memory_findings,
    verdict_notes,
)
from verl_safe_launch.preflight import rechecked, rule_context
from verl_safe_launch.presets import compose_for_launch
from verl_safe_launch.render import Column, findings_json, json_document, render_finding, render_table

MAX_OVERHEAD_GIB = 1024
EXAMPLES = """\
  verl-safe-launch estimate -c launch_examples/grpo_6gpu.yaml hardware.gpu_memory_gb=80
  verl-safe-launch estimate --fit -c launch_examples/grpo_6gpu.yaml hardware.gpu_memory_gb=80
  verl-safe-launch estimate --fit --margin 0.2 actor_rollout_ref.model.path=Qwen/Qwen3-8B hardware.gpu_memory_gb=141
  verl-safe-launch estimate --format json -c run.yaml hardware.gpu_memory_gb=80
"""
SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "gathered parameters": "gathered",
    "activations": "activ",
    "logits and temporaries": "logits",
    "KV cache": "KV",
    "fixed overhead": "overhead",
}


def main(args: Sequence[str], offset: int) -> int:
    """Run ``estimate``."""
    parser = make_parser(
        "estimate",
        "Estimate GPU memory per stage (rollout, old log-prob, ref log-prob, actor update, critic) and component; "
        "judge it against hardware.gpu_memory_gb. All figures are GiB per GPU.",
        EXAMPLES,
    )
    parser.add_argument(
        "--fit", action="store_true", help="find the largest micro batches that fit and pass the rules"
    )
    parser.add_argument(
        "--margin", type=float, default=0.10, help="head room kept free on the GPU (default 0.1)"
    )
    parser.add_argument(
        "--overhead",
        type=float,
        default=DEFAULT_OVERHEAD_GIB,
        metavar="GIB",
        help=f"CUDA context and NCCL buffers per process in GiB (default {DEFAULT_OVERHEAD_GIB:g})",
    )
    add_compose_args(parser)
    ns = parse(parser, args)
    if not 0 <= ns.margin < 1:
        raise UsageError(
            f"--margin {ns.margin:g} is outside [0, 1)", where="--margin", fix="e.g. --margin 0.1"
        )
    if not 0 <= ns.overhead <= MAX_OVERHEAD_GIB:
        raise UsageError(
            f"--overhead {ns.overhead:g} is outside [0, {MAX_OVERHEAD_GIB}] GiB",
            where="--overhead",
            fix="e.g. --overhead 1",
        )
    ctx = rule_context(require_accepted(compose_for_launch(request_from_args(ns, args, offset))))
    est = estimate_memory(ctx, margin=ns.margin, overhead_gib=ns.overhead)
    if est.missing:
        raise InputError(
            est.missing.split(";")[0],
            where="actor_rollout_ref.model.path / critic.model.path",
            fix=est.missing.split("; ", 1)[1],
        )
    fits = fit_knobs(ctx, margin=ns.margin) if ns.fit else ()
    if ns.format == "json":
        print_json(to_json(ctx, est, fits))
    else:
        print(render(ctx, est, fits, ns.fit), end="")
    return EXIT_OK


def _cell(value: float) -> str:
    return f"{value:.1f}" if value >= 0.05 else "-"


def table(est: MemoryEstimate) -> list[str]:
    """One row per stage: the components, the total, the band and the verdict."""
    cols = [c for c in COMPONENTS if any(s.get(c) >= 0.05 for s in est.stages)]
    columns = [
        Column("stage", min_width=13),
        *(Column(SHORT[c], "right", 8) for c in cols),
        Column("total", "right", 8),
        Column("band", min_width=12),
        Column("verdict"),
    ]
    rows = [
        (
            s.name,
            *(_cell(s.get(c)) for c in cols),
            f"{s.total:.1f}",
            f"{s.low:.1f}–{s.high:.1f}",
            s.verdict_text or "no GPU size",
        )
        for s in est.stages
    ]
    return render_table(columns, rows, gap=1).rstrip("\n").split("\n")


def render(ctx: RuleContext, est: MemoryEstimate, fits: Sequence[KnobFit], fit: bool) -> str:
    """The text report: table, peak phases, findings, assumptions and (with --fit) the overrides."""
    gpus = (
        f"{ctx.hardware.gpu_memory_gb:g} GiB"
        if ctx.hardware.gpu_memory_gb
        else "unknown size (hardware.gpu_memory_gb)"
    )
    arch = ctx.actor_arch
    lines = [
        f"GPU memory per GPU (GiB) for {arch.name if arch else '?'} ({arch.source if arch else ''}); GPU: {gpus}"
    ]
    notes = [*est.notes, *verdict_notes(ctx, est)]
    lines += ["", *table(est), *(f"note: {n}" for n in notes), "", "peaks:"]
    for s in est.stages:
        lines.append(f"  {s.name:<13} {s.phase}; {s.batch}")
        if s.phases:
            lines.append("  " + " " * 14 + "; ".join(f"{name} {gib:.1f} GiB" for name, gib in s.phases))
    lines += host_lines(est)
    lines += ["", "assumptions:", *(f"  - {a}" for a in est.assumptions)]
    if est.host is not None:
        lines += [f"  - {a}" for a in est.host.assumptions]
    findings = rechecked(memory_findings(ctx, est), ctx)
    if findings:
        lines += ["", *(render_finding(f) for f in findings)]
    if fit:
        lines += ["", *fit_lines(fits, est.margin), *(f"note: {n}" for n in fit_notes(ctx, fits, est.margin))]
    return "\n".join(lines) + "\n"


def host_lines(est: MemoryEstimate) -> list[str]:
    """Host RAM per node: the total against the node's memory, then the components."""
    host = est.host
    if host is None:
        return []
    limit = f" of {host.host_memory_gib:g} GiB" if host.host_memory_gib else " (host memory unknown)"
    parts = ", ".join(f"{c} {v:.1f}" for c, v in host.components)
    return ["", f"host RAM per node: ~{host.total:.1f} GiB{limit}: {parts}"]


def fit_lines(fits: Sequence[KnobFit], margin: float) -> list[str]:
    """The fitted knobs, then one line of overrides to paste."""
    lines = [f"fit (largest values that fit with the {margin:.0%} margin and pass every rule):"]
    for f in fits:
        now = "unset" if f.current is None else str(f.current)
        shown = f.override or f"{f.key}: nothing fits"
        lines.append(f"  {shown:<64} (now {now}; {f.reason})")
    pasted = [f.override for f in fits if f.override]
    if pasted:
        lines += ["paste:", "  " + " ".join(pasted)]
    return lines


def _stage_json(s: StageEstimate) -> dict[str, Any]:
    return {
        "name": s.name,
        "components_gib": {c: round(v, 3) for c, v in s.components},
        "total_gib": round(s.total, 3),
        "band_gib": [round(s.low, 3), round(s.high, 3)],
        "verdict": s.verdict,
        "traced": s.traced,
        "phase": s.phase,
        "batch": s.batch,
        "knob": s.knob,
        "phases_gib": {name: round(gib, 3) for name, gib in s.phases},
    }


def to_json(ctx: RuleContext, est: MemoryEstimate, fits: Sequence[KnobFit]) -> dict[str, Any]:
    """The stable JSON form of the estimate (and the fit, when asked)."""
    arch = ctx.actor_arch
    r = est.rollout
    fields = {
        "model": {"name": arch.name, "source": arch.source} if arch else None,
        "gpu_memory_gib": est.gpu_memory_gib,
        "margin": est.margin,
        "stages": [_stage_json(s) for s in est.stages],
        "rollout": None
        if r is None
        else {
            "kv_capacity_tokens": r.capacity_tokens,
            "kv_bytes_per_token": r.kv_bytes_per_token,
            "max_model_len": r.max_model_len,
            "wanted_tokens": r.wanted_tokens,
        },
        "assumptions": list(est.assumptions),
        "host": None
        if est.host is None
        else {
            "components_gib": {c: round(v, 3) for c, v in est.host.components},
            "total_gib": round(est.host.total, 3),
            "host_memory_gib": est.host.host_memory_gib,
        },
        "findings": findings_json(rechecked(memory_findings(ctx, est), ctx)),
        "fit": [
            {
                "key": f.key,
                "current": f.current,
                "value": f.value,
                "peak_gib": round(f.peak_gib, 3),
                "override": f.override,
                "reason": f.reason,
            }
            for f in fits
        ],
    }
    return json_document(fields)

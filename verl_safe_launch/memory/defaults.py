"""Defaults an answer rests on: a memory verdict or a fit that a declarable fact would change says which, and how.

Today that is flash-attn's cross-entropy. Where nothing tells whether the GPU nodes have flash-attn, the estimate
takes verl's other log-prob path (a larger logits term) rather than risk a 'fits' that fails; when that choice
changes a verdict or a fitted value, the report says so, with the figure under the other path and the token that
declares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from verl_safe_launch.context import RuleContext
from verl_safe_launch.memory.assumptions import flash_decides
from verl_safe_launch.memory.estimate import FITS, MemoryEstimate, StageEstimate, estimate_memory
from verl_safe_launch.memory.fit import KnobFit, fit_knobs

FLASH_TOKEN = "hardware.flash_attn=true"
WHERE = "if the GPU nodes have flash-attn installed (verl then uses its cross-entropy for log-probs)"


def flash_unknown(ctx: RuleContext) -> bool:
    """Whether the log-prob path rests on the default only because nobody said whether flash-attn is there."""
    return ctx.hardware.flash_attn is None and flash_decides(ctx)


def with_flash(ctx: RuleContext) -> RuleContext:
    """The same launch with flash-attn declared."""
    return replace(ctx, hardware=replace(ctx.hardware, flash_attn=True))


def flash_fits(ctx: RuleContext, est: MemoryEstimate) -> dict[str, StageEstimate]:
    """The stages that do not fit but would with flash-attn's cross-entropy, each as it would be then."""
    misses = [s.name for s in est.stages if s.verdict not in (FITS, None) and s.name != "rollout"]
    if not misses or not flash_unknown(ctx):
        return {}
    other = estimate_memory(with_flash(ctx), margin=est.margin)
    found = {name: other.stage(name) for name in misses}
    return {name: alt for name, alt in found.items() if alt is not None and alt.verdict == FITS}


def flash_clause(alt: StageEstimate) -> str:
    """``with flash-attn's cross-entropy it would need ~58.1 GiB and fit: declare ...``."""
    return f"with flash-attn's cross-entropy it would need ~{alt.total:.1f} GiB and fit: declare {FLASH_TOKEN} {WHERE}"


def verdict_notes(ctx: RuleContext, est: MemoryEstimate) -> list[str]:
    """For each stage that does not fit but would with flash-attn's cross-entropy: one line saying so."""
    verdicts = {s.name: s.verdict for s in est.stages}
    return [
        f"{name} {verdicts[name]} assuming no flash-attn cross-entropy (not known for the GPU nodes); "
        + flash_clause(alt)
        for name, alt in flash_fits(ctx, est).items()
    ]


def fit_notes(ctx: RuleContext, fits: Sequence[KnobFit], margin: float) -> list[str]:
    """Fitted values that flash-attn's cross-entropy would raise: the values, and the token that declares it."""
    if not flash_unknown(ctx):
        return []
    bolder = {f.key: f for f in fit_knobs(with_flash(ctx), margin)}
    raised = [
        b
        for f in fits
        if (b := bolder.get(f.key)) is not None
        and b.value is not None
        and (f.value is None or b.value > f.value)
    ]
    if not raised:
        return []
    values = ", ".join(f"{b.key}={b.value}" for b in raised)
    return [
        f"these values assume no flash-attn cross-entropy (not known for the GPU nodes); with {FLASH_TOKEN} "
        f"{WHERE}: {values}"
    ]


__all__ = [
    "FLASH_TOKEN",
    "fit_notes",
    "flash_clause",
    "flash_fits",
    "flash_unknown",
    "verdict_notes",
    "with_flash",
]

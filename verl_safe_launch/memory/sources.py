"""Where a model's activation and logits terms come from, and the error band measured for that source.

A family with a calibrated row takes its byte formulas (the fast path: nothing is imported or traced). Any other
model has its terms derived from its own code (``derive``). When transformers cannot build the model, the closest
calibrated family stands in, with the worst error measured for that family's row across every traced family as
its band. Every band is measured by ``bench/calibrate_memory.py --bands`` against full-depth traces and shipped in
``data/memory_bands.json``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from verl_safe_launch.context import Architecture
from verl_safe_launch.memory.derive import with_traced
from verl_safe_launch.memory.terms import FAMILIES, calibrated


@dataclass(frozen=True)
class TermSource:
    """The architecture with the terms the estimate uses, how they were obtained, and their measured band."""

    arch: Architecture
    how: str
    band: float
    traced: bool
    """The terms were checked against traces of this model's code (a calibrated row or a derivation)."""
    fallback: str = ""
    """The calibrated family standing in when the model's code could not be traced (empty otherwise)."""


@functools.cache
def bands() -> dict[str, Any]:
    """The measured error bands (fractions of activations plus logits) shipped with the package."""
    text = resources.files("verl_safe_launch.data").joinpath("memory_bands.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def row_band(model_type: str) -> float:
    """The worst error measured for a calibrated row on its own family (the worst of all rows when its family
    has no traced model of its own)."""
    rows: dict[str, float] = bands()["rows"]
    return rows.get(model_type, max(rows.values()))


def derived_band() -> float:
    """The worst error measured for the derivation across every traced family."""
    return float(bands()["derived"])


def fallback_band(family: str) -> float:
    """The worst error measured when ``family``'s row stands in for every traced family."""
    cross: dict[str, float] = bands()["fallback"]
    return cross.get(family, max(cross.values()))


def resolve(arch: Architecture) -> TermSource:
    """The terms of ``arch``: its calibrated row, terms derived from its code, or the closest family's row."""
    if calibrated(arch):
        how = f"calibrated row '{arch.model_type}' (traced family)"
        return TermSource(arch, how, row_band(arch.model_type), True)
    derived, why = with_traced(arch)
    if derived.traced is not None:
        return TermSource(derived, derived.traced.describe(), derived_band(), True)
    family = closest_family(arch)
    band = fallback_band(family)
    how = (
        f"model code not traceable ({why}): closest traced family '{family}' stands in, activations and logits "
        f"±{band:.0%} (the worst error measured for its row on other families)"
    )
    return TermSource(replace(arch, model_type=family), how, band, False, fallback=family)


def closest_family(arch: Architecture) -> str:
    """The calibrated family most like ``arch``: latent attention, experts and softcapping first, then the
    name; Llama when nothing else matches."""

    def score(family: str) -> tuple[int, int, int]:
        shape = (
            int(family == "deepseek_v2") == int(arch.mla),
            int(family in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2"))
            == int(bool(arch.num_experts)),
            int(family == "gemma2") == int(bool(arch.final_logit_softcapping)),
        )
        prefix = _common_prefix(family, arch.model_type)
        return (sum(shape), prefix, int(family == "llama"))

    return max(sorted(FAMILIES), key=score)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

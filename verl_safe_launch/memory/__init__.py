"""The per-stage GPU memory model, its findings, and the micro-batch fit."""

from __future__ import annotations

from verl_safe_launch.memory.checks import memory_findings
from verl_safe_launch.memory.defaults import FLASH_TOKEN, fit_notes, flash_unknown, verdict_notes
from verl_safe_launch.memory.engine import CRITIC_V1_BUDGET, CRITIC_V1_BUDGET_DEFAULT
from verl_safe_launch.memory.estimate import (
    COMPONENTS,
    DEFAULT_OVERHEAD_GIB,
    MemoryEstimate,
    StageEstimate,
    estimate_memory,
    stage_at,
)
from verl_safe_launch.memory.fit import KnobFit, candidates, fit_knobs
from verl_safe_launch.memory.host import HostEstimate, host_estimate, host_findings
from verl_safe_launch.memory.terms import (
    GIB,
    Entropy,
    Pass,
    kv_bytes_per_token,
    layer_saved,
    logits_bytes,
    model_params,
    pass_peak,
)

__all__ = [
    "COMPONENTS",
    "CRITIC_V1_BUDGET",
    "CRITIC_V1_BUDGET_DEFAULT",
    "DEFAULT_OVERHEAD_GIB",
    "FLASH_TOKEN",
    "GIB",
    "Entropy",
    "HostEstimate",
    "KnobFit",
    "MemoryEstimate",
    "Pass",
    "StageEstimate",
    "candidates",
    "estimate_memory",
    "fit_knobs",
    "fit_notes",
    "flash_unknown",
    "host_estimate",
    "host_findings",
    "kv_bytes_per_token",
    "layer_saved",
    "logits_bytes",
    "memory_findings",
    "model_params",
    "pass_peak",
    "stage_at",
    "verdict_notes",
]

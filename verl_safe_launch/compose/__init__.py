"""Composition of verl's config exactly as verl's Hydra entry point would, with every value's provenance."""

from __future__ import annotations

from verl_safe_launch.compose.budget import check_interpolation_budget
from verl_safe_launch.compose.engine import Composed, Rejected, build_view, compose, require_accepted
from verl_safe_launch.compose.interpolation import Resolver
from verl_safe_launch.compose.layers import available_presets, preset_dir
from verl_safe_launch.compose.overlay import Overlay, config_groups, model_engines, parse_value
from verl_safe_launch.compose.resolution import resolution_findings, structure_findings

__all__ = [
    "Composed",
    "Overlay",
    "Rejected",
    "Resolver",
    "available_presets",
    "build_view",
    "check_interpolation_budget",
    "compose",
    "config_groups",
    "model_engines",
    "parse_value",
    "preset_dir",
    "require_accepted",
    "resolution_findings",
    "structure_findings",
]

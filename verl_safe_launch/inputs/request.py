"""What one composition reads (override tokens, user YAML files, computed writes), built one way for every verb."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.inputs.overrides import OverrideToken, cli_tokens
from verl_safe_launch.inputs.verl_paths import PRIMARY_CONFIG
from verl_safe_launch.provenance import Write


@dataclass(frozen=True)
class ComposeRequest:
    """Everything composition reads: override tokens (CLI or script) and user YAML files, in order.

    ``adapted`` are computed writes applied right after the preset (hardware adaptation); ``fills`` are
    applied last, and only to keys that nothing but verl's defaults has set (hardware facts).
    """

    overrides: tuple[OverrideToken, ...] = ()
    config_files: tuple[Path, ...] = ()
    adapted: tuple[Write, ...] = ()
    fills: tuple[Write, ...] = ()
    preset: str | None = None
    lenient: bool = False
    """Record overrides Hydra refuses (unknown key, '+' on an existing key) on ``Composed.rejected``
    instead of raising, so that a pre-flight can report every problem at once."""
    named_configs: tuple[Path, ...] = ()
    """Config files (a script's own ``--config-name``) whose ``defaults`` list the reader already turned into
    group choices: composed as user layers without refusing their ``defaults:``."""
    config_name: str = PRIMARY_CONFIG
    """The config of verl's own config directory that Hydra composes first (``--config-name``, or the verl config
    a user config file names in its ``defaults``): ``ppo_trainer``, ``ppo_megatron_trainer``..."""


def override_positions(args: Sequence[str], overrides: Sequence[str], offset: int) -> list[int]:
    """1-based argv positions of the overrides (the verb, when given, is argument 1)."""
    positions: list[int] = []
    start = 0
    for text in overrides:
        index = list(args).index(text, start)
        positions.append(index + 1 + offset)
        start = index + 1
    return positions


def request_from_args(
    ns: argparse.Namespace,
    args: Sequence[str],
    offset: int,
    *,
    lenient: bool = True,
    fills: tuple[Write, ...] = (),
) -> ComposeRequest:
    """The request of a verb's parsed arguments: overrides with their argv positions, ``-c`` files in order.

    Lenient by default: overrides Hydra refuses are collected (``Composed.rejected``) so that a verb can
    report every problem at once.
    """
    texts = list(getattr(ns, "overrides", None) or [])
    tokens = cli_tokens(texts, override_positions(args, texts, offset))
    files = tuple(Path(p) for p in getattr(ns, "config", None) or [])
    return ComposeRequest(overrides=tokens, config_files=files, fills=fills, lenient=lenient)

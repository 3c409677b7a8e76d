"""Command-line override tokens: parsed with Hydra's own parser, tool tokens split from verl's namespace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_safe_launch.errors import UsageError
from verl_safe_launch.provenance import Layer, Source

HARDWARE_KEYS = ("nodes", "gpus_per_node", "gpu_memory_gb", "gpu_name", "flash_attn", "host_memory_gb")


@dataclass(frozen=True)
class OverrideToken:
    """One raw override as the user wrote it, with where it was written."""

    text: str
    source: Source


@dataclass(frozen=True)
class ToolSettings:
    """Tokens outside verl's namespace: ``preset=NAME`` and ``hardware.*``."""

    preset: tuple[str, Source] | None = None
    hardware: dict[str, tuple[str, Source]] = field(default_factory=dict)


def cli_tokens(texts: Sequence[str], positions: Sequence[int] | None = None) -> tuple[OverrideToken, ...]:
    """Wrap command-line texts as tokens; ``positions`` are 1-based argv positions."""
    pos = list(positions) if positions is not None else list(range(1, len(texts) + 1))
    return tuple(
        OverrideToken(text, Source(Layer.CLI, arg_index=index, raw=text))
        for text, index in zip(texts, pos, strict=True)
    )


def split_tool_tokens(tokens: Sequence[OverrideToken]) -> tuple[tuple[OverrideToken, ...], ToolSettings]:
    """Separate ``preset=`` and ``hardware.*=`` tokens from the overrides meant for verl."""
    verl: list[OverrideToken] = []
    preset: tuple[str, Source] | None = None
    hardware: dict[str, tuple[str, Source]] = {}
    for token in tokens:
        key, sep, value = token.text.partition("=")
        if sep and key == "preset":
            preset = (value, token.source)
        elif sep and key.startswith("hardware."):
            name = key[len("hardware.") :]
            if name not in HARDWARE_KEYS:
                raise UsageError(
                    f"unknown hardware token '{key}'",
                    where=token.source.describe(),
                    fix="use one of " + ", ".join(f"hardware.{k}" for k in HARDWARE_KEYS),
                )
            hardware[name] = (value, token.source)
        else:
            verl.append(token)
    return tuple(verl), ToolSettings(preset, hardware)


def parse_override(token: OverrideToken) -> Any:
    """Parse one token with Hydra's override parser; raise a UsageError naming its position."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(token.text)
    except HydraException as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(
            f"invalid override '{token.text}': {detail}",
            where=token.source.describe(),
            fix="write overrides as key=value, +key=value, ++key=value or ~key "
            "(quote values containing spaces or brackets)",
        ) from None

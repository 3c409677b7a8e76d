"""Command-line override tokens: parsed with Hydra's own parser, tool tokens split from verl's namespace."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_safe_launch.errors import UsageError
from verl_safe_launch.provenance import Layer, Source

_SWEEPS = ("choice", "range", "interval", "shuffle", "glob")
HARDWARE_KEYS = (
    "nodes",
    "gpus_per_node",
    "gpu_memory_gb",
    "gpu_name",
    "flash_attn",
    "host_memory_gb",
    "cpus_per_node",
)


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


def _refuse_prefixed_tool_token(token: OverrideToken, key: str, value: str) -> None:
    """``+preset=``/``~preset``/``++hardware.nodes=``: Hydra's prefixes mean nothing on tool tokens; never ignore them."""
    bare = key.lstrip("+~")
    if bare != key and (bare == "preset" or bare.startswith("hardware.")):
        raise UsageError(
            f"'{token.text}': {bare} is a verl-safe-launch token, not a verl key, so '{key[: len(key) - len(bare)]}' "
            "does not apply to it ('+preset=' is the spelling for verl's own entry point)",
            where=token.source.describe(),
            fix=f"write {bare}={value}" if value else f"drop '{token.text}'",
        )


def _one_preset(current: tuple[str, Source] | None, value: str, token: OverrideToken) -> tuple[str, Source]:
    """The preset a token names; an empty name or a second, different preset is a UsageError."""
    if not value.strip():
        raise UsageError(
            "'preset=' names no preset",
            where=token.source.describe(),
            fix="name one (see 'verl-safe-launch presets'), or drop the token",
        )
    if current is not None and current[0] != value:
        raise UsageError(
            f"two presets: preset={current[0]} ({current[1].describe()}) and preset={value}",
            where=token.source.describe(),
            fix="keep one preset=NAME; a preset is a whole starting point, they do not stack",
        )
    return (value, token.source)


def split_tool_tokens(tokens: Sequence[OverrideToken]) -> tuple[tuple[OverrideToken, ...], ToolSettings]:
    """Separate ``preset=`` and ``hardware.*=`` tokens from the overrides meant for verl."""
    verl: list[OverrideToken] = []
    preset: tuple[str, Source] | None = None
    hardware: dict[str, tuple[str, Source]] = {}
    for token in tokens:
        key, sep, value = token.text.partition("=")
        _refuse_prefixed_tool_token(token, key, value)
        if sep and key == "preset":
            preset = _one_preset(preset, value, token)
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
    from hydra.errors import HydraException

    try:
        override = _parsed(token.text)
    except HydraException as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(
            f"invalid override '{token.text}': {detail}",
            where=token.source.describe(),
            fix="write overrides as key=value, +key=value, ++key=value or ~key "
            "(quote values containing spaces or brackets)",
        ) from None
    if override.is_sweep_override():
        raise _sweep_error(token, override)
    return override


@functools.lru_cache(maxsize=8192)
def _parsed(text: str) -> Any:
    """Hydra's parse of one override's text (never mutated after parsing: a folder's scripts repeat the same
    overrides, and the parser, built with its grammar functions, is itself costly to make)."""
    return _parser().parse_override(text)


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _sweep_error(token: OverrideToken, override: Any) -> UsageError:
    """verl runs one config: Hydra refuses a sweep without ``--multirun``, which verl's entry point never passes."""
    key = override.get_key_element()
    value = token.text.partition("=")[2].strip()
    function = value.partition("(")[0].strip()
    what = (
        f"is a Hydra sweep ({function}(...))"
        if function in _SWEEPS
        else "is a Hydra sweep over several values"
    )
    fix = f"write one value (a list is {key}=[a,b], a string with commas is quoted: {key}='a,b'); "
    fix += "to try several, launch once per value"
    return UsageError(
        f"'{token.text}' {what}: verl runs one config and refuses it",
        where=token.source.describe(),
        fix=fix,
    )

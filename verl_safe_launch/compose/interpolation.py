"""Resolve the interpolations verl's YAML uses (``${a.b}``, ``${.x}``, ``${oc.select:key,default}``) on a flat view.

OmegaConf parses every interpolation with its ANTLR grammar, which costs milliseconds each; this resolver
handles the forms verl 0.9.1 writes and raises ``Unsupported`` for anything else, so callers can fall back to
OmegaConf. Its results are checked against OmegaConf on every interpolation of verl's composed defaults.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from verl_safe_launch.config_view import nest

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][+-]?\d+)")
_PLAIN = re.compile(r"[A-Za-z0-9_\-./]+")
_MAX_DEPTH = 32


class Unsupported(Exception):
    """An interpolation this resolver does not model; use OmegaConf instead."""


Leaves = Callable[[str], list[str]]


class Resolver:
    """Resolves values of a flat ``key -> raw value`` mapping; ``leaves(prefix)`` lists the keys of a subtree."""

    def __init__(self, raw: Mapping[str, Any], leaves: Leaves) -> None:
        self.raw = raw
        self.leaves = leaves

    def value(self, key: str, depth: int = 0) -> Any:
        """The resolved value of ``key`` (a leaf of the flat mapping)."""
        if depth > _MAX_DEPTH:
            raise Unsupported(f"interpolation chain too deep at {key}")
        raw = self.raw[key]
        if not isinstance(raw, str) or "${" not in raw:
            return raw
        return self._string(key, raw, depth)

    def _string(self, key: str, text: str, depth: int) -> Any:
        pieces = _split(text)
        if len(pieces) == 1 and pieces[0][0]:
            return self._interpolation(key, pieces[0][1], depth)
        out: list[str] = []
        for is_interp, piece in pieces:
            out.append(str(self._interpolation(key, piece, depth)) if is_interp else piece)
        return "".join(out)

    def _interpolation(self, key: str, body: str, depth: int) -> Any:
        if body.startswith("oc.select:"):
            target, default = _split_args(body[len("oc.select:") :])
            found, value = self._lookup(key, target.strip(), depth, select=True)
            if found:
                return value
            if default is None:
                return None
            return self._literal(key, default.strip(), depth)
        if ":" in body or "," in body:
            raise Unsupported(body)
        found, value = self._lookup(key, body.strip(), depth)
        if not found:
            raise Unsupported(f"missing {body}")
        return value

    def _lookup(self, key: str, target: str, depth: int, *, select: bool = False) -> tuple[bool, Any]:
        """``oc.select`` treats a mandatory-missing ('???') target as absent; a plain reference cannot."""
        absolute = absolute_key(key, target)
        if absolute in self.raw:
            if self.raw[absolute] == "???":
                if select:
                    return False, None
                raise Unsupported(f"{absolute} is missing")
            return True, self.value(absolute, depth + 1)
        leaves = self.leaves(absolute)
        if not leaves:
            return False, None
        cut = len(absolute) + 1
        return True, nest((leaf[cut:], self.value(leaf, depth + 1)) for leaf in leaves)

    def _literal(self, key: str, text: str, depth: int) -> Any:
        if text.startswith("${") and text.endswith("}"):
            return self._string(key, text, depth)
        lowered = text.lower()
        if lowered == "null":
            return None
        if lowered in ("true", "false"):
            return lowered == "true"
        if _INT.fullmatch(text):
            return int(text)
        if _FLOAT.fullmatch(text):
            return float(text)
        if text == "{}":
            return {}
        if text == "[]":
            return []
        if _PLAIN.fullmatch(text) and lowered not in ("inf", "nan", "-inf", "+inf"):
            return text
        raise Unsupported(text)


@functools.lru_cache(maxsize=4096)
def _split(text: str) -> tuple[tuple[bool, str], ...]:
    """``a${x}b`` → [(False, 'a'), (True, 'x'), (False, 'b')]; nested ``${`` kept inside one piece."""
    pieces: list[tuple[bool, str]] = []
    i = 0
    while i < len(text):
        start = text.find("${", i)
        if start < 0:
            pieces.append((False, text[i:]))
            break
        if start > i:
            pieces.append((False, text[i:start]))
        end = _closing(text, start)
        pieces.append((True, text[start + 2 : end]))
        i = end + 1
    if any("\\" in piece for _, piece in pieces):
        raise Unsupported(text)
    return tuple(pieces)


def _closing(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise Unsupported(text)


@functools.lru_cache(maxsize=4096)
def _split_args(text: str) -> tuple[str, str | None]:
    depth = 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch in "'\"[":
            raise Unsupported(text)
        elif ch == "," and depth == 0:
            return text[:i], text[i + 1 :]
    return text, None


def absolute_key(key: str, target: str) -> str:
    """The absolute key an interpolation in ``key`` reads: ``${.x}`` is a sibling, ``${..x}`` one level up."""
    if not target.startswith("."):
        return target
    dots = len(target) - len(target.lstrip("."))
    return ".".join([*key.split(".")[:-dots], target.lstrip(".")])

"""Nearest valid values for a failed divisibility rule, rendered as overrides you can paste."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verl_safe_launch.config_view import format_value

MAX_LISTED = 24
MAX_SEARCH = 100_000
"""The most candidates a fix search tries on each side, so that an absurd value (1e18) never hangs it."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order (empty for n < 1, and past MAX_SEARCH² = 1e10)."""
    if not 1 <= n <= MAX_SEARCH**2:
        return []
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


def nearest(value: int, ok: Callable[[int], bool], limit: int | None = None) -> list[int]:
    """The closest positive integers below and above ``value`` for which ``ok`` holds, nearest first.

    Ties go to the smaller value. The search stops at ``limit`` (default: 4 × value + 64).
    """
    top = min(limit if limit is not None else 4 * value + 64, value + MAX_SEARCH)
    below = next((v for v in range(value - 1, max(value - 1 - MAX_SEARCH, 0), -1) if ok(v)), None)
    above = next((v for v in range(value + 1, top + 1) if ok(v)), None)
    found = [v for v in (below, above) if v is not None]
    return sorted(found, key=lambda v: (abs(v - value), v))


def largest_first_at_most(value: int, valid: Sequence[int]) -> list[int]:
    """``valid`` reordered so that the largest entry ≤ ``value`` comes first (the memory-safe choice)."""
    at_most = [v for v in valid if v <= value]
    if not at_most:
        return list(valid)
    best = at_most[-1]
    return [best, *(v for v in valid if v != best)]


@dataclass(frozen=True)
class KeyFix:
    """One way out: set ``key`` to ``values[0]`` (alternatives follow), pasting ``extra`` tokens with it."""

    key: str
    values: tuple[object, ...]
    complete: bool = False
    extra: tuple[str, ...] = ()

    def tokens(self) -> tuple[str, ...]:
        """The overrides of the first suggestion."""
        return (*self.extra, f"{self.key}={format_value(self.values[0])}")

    def render(self) -> str:
        """``key=6 (valid: 1, 2, 3, 6)`` or ``key=64 (or 72)``."""
        head = " ".join(self.tokens())
        if self.complete:
            listed = sorted(v for v in self.values if isinstance(v, int))
            shown = ", ".join(str(v) for v in listed[:MAX_LISTED])
            more = ", …" if len(listed) > MAX_LISTED else ""
            return f"{head} (valid: {shown}{more})"
        rest = self.values[1:]
        return f"{head} (or {', '.join(format_value(v) for v in rest)})" if rest else head


def set_fix(key: str, value: object, extra: tuple[str, ...] = ()) -> KeyFix:
    """Set ``key`` to one value."""
    return KeyFix(key, (value,), extra=extra)


def divisor_fix(key: str, current: int | None, whole: int, extra: tuple[str, ...] = ()) -> KeyFix | None:
    """Set ``key`` to a divisor of ``whole``: the largest one ≤ the current value first, then all of them."""
    valid = divisors(whole)
    if not valid:
        return None
    ordered = largest_first_at_most(current, valid) if current is not None else valid
    return KeyFix(key, tuple(ordered), complete=True, extra=extra)


def search_fix(
    key: str, current: int | None, ok: Callable[[int], bool], limit: int | None = None
) -> KeyFix | None:
    """Set ``key`` to the nearest value (below or above the current one) that satisfies ``ok``."""
    if current is None:
        return None
    found = nearest(current, ok, limit)
    return KeyFix(key, tuple(found)) if found else None


def render_fix(fixes: Sequence[KeyFix | None]) -> str | None:
    """Alternatives joined with ``; or``; the first one alone fixes the problem."""
    parts = [fix.render() for fix in fixes if fix is not None]
    return "; or ".join(parts) if parts else None


def first_tokens(fix: str) -> list[str]:
    """The override tokens of the first suggestion in a rendered fix (what a user would paste first)."""
    first = fix.split("; or ")[0]
    head = first.split(" (")[0]
    return head.split()

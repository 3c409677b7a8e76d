"""A budget on interpolations, checked on the raw values before anything resolves them.

OmegaConf resolves every interpolation afresh each time it is read (no cache), so a value that reads another
twice, sixteen levels deep, costs 2**16 resolutions, and a chain of 2,000 keys costs 2,000 nested ones per key
(past about 60 levels OmegaConf itself fails with a RecursionError). The cost of resolving every value is
counted here in one pass over the reference graph (each key visited once), and a config over a limit is refused
before OmegaConf, ``show``, ``check`` or verl resolve anything.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.compose.interpolation import absolute_key
from verl_safe_launch.errors import ConfigError

MAX_INTERPOLATION_DEPTH = 32
"""The longest chain of interpolations one value may follow (verl's own YAML needs 2)."""
MAX_RESOLVED_CHARS = 65_536
"""The longest text one value may resolve to (the same limit as an expanded shell value)."""
MAX_INTERPOLATION_WORK = 4_000
"""The most interpolations resolving every value of the config may evaluate (verl's defaults need about 120)."""

_OPEN = re.compile(r"\$\{")
_REF = re.compile(r"\$\{\s*(?:oc\.select:\s*)?([A-Za-z0-9_.\-/]+)\s*([,}:]?)")


@dataclass(frozen=True)
class _Cost:
    work: int
    chars: int
    depth: int


Describe = Callable[[str], str | None]


def check_interpolation_budget(raw: Mapping[str, Any], where: Describe) -> None:
    """Raise a ConfigError naming the first value over a limit; ``where(key)`` says who set a key."""
    costs = _Costs(raw)
    total = 0
    for key, value in raw.items():
        if not _interpolated(value):
            continue
        cost = costs.of(key)
        total = min(total + cost.work, MAX_INTERPOLATION_WORK + 1)
        if _over(cost):
            culprit = costs.culprit(key)
            _check_value(culprit, raw[culprit], costs.of(culprit), where)
        if total > MAX_INTERPOLATION_WORK:
            raise _error(
                f"resolving the config's interpolations takes over {MAX_INTERPOLATION_WORK:,} steps "
                f"(the limit), {key} among them",
                key,
                where,
            )


def _over(cost: _Cost) -> bool:
    return (
        cost.depth > MAX_INTERPOLATION_DEPTH
        or cost.chars > MAX_RESOLVED_CHARS
        or cost.work > MAX_INTERPOLATION_WORK
    )


def _check_value(key: str, value: str, cost: _Cost, where: Describe) -> None:
    if cost.depth > MAX_INTERPOLATION_DEPTH:
        what = f"follows a chain of over {MAX_INTERPOLATION_DEPTH} interpolations (the limit)"
    elif cost.chars > MAX_RESOLVED_CHARS:
        what = f"resolves to over {MAX_RESOLVED_CHARS:,} characters (the limit)"
    elif cost.work > MAX_INTERPOLATION_WORK:
        what = f"takes over {MAX_INTERPOLATION_WORK:,} interpolation steps to resolve (the limit)"
    else:
        return
    raise _error(f"{key}={_short(value)} {what}", key, where)


def _error(what: str, key: str, where: Describe) -> ConfigError:
    return ConfigError(
        f"interpolation limit: {what}",
        where=where(key),
        fix=f"write {key} as a value, or point it at a key that holds one",
    )


def _short(value: str) -> str:
    return value if len(value) <= 60 else value[:57] + "..."


def _interpolated(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


class _Costs:
    """Each key's cost, computed once per key without recursion (a chain of any length is safe)."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.done: dict[str, _Cost] = {}
        self.children: dict[str, list[str]] = {}
        self.targets: dict[str, list[str]] = {}
        for key in raw:
            parts = key.split(".")
            for cut in range(1, len(parts)):
                self.children.setdefault(".".join(parts[:cut]), []).append(key)

    def of(self, key: str) -> _Cost:
        stack = [key]
        active: set[str] = set()
        while stack:
            top = stack[-1]
            if top in self.done:
                stack.pop()
                continue
            pending = [t for t in self._targets(top) if t not in self.done and t not in active]
            if pending and top not in active:
                active.add(top)
                stack.extend(pending)
                continue
            stack.pop()
            active.discard(top)
            self.done[top] = self._combine(top)
        return self.done[key]

    def culprit(self, key: str) -> str:
        """The key over a limit whose own targets are not: where a bomb or a chain starts to grow."""
        while True:
            over = [t for t in self._targets(key) if _interpolated(self.raw[t]) and _over(self.of(t))]
            if not over:
                return key
            key = over[0]

    def _targets(self, key: str) -> list[str]:
        """The leaves ``key`` reads (a reference to a subtree reads every leaf below it)."""
        if key not in self.targets:
            self.targets[key] = self._scan(key)
        return self.targets[key]

    def _scan(self, key: str) -> list[str]:
        value = self.raw.get(key)
        if not isinstance(value, str) or "${" not in value:
            return []
        out: list[str] = []
        for match in _REF.finditer(value):
            if match.group(2) == ":":
                continue  # a resolver call (oc.env:...): its arguments' own ${...} are matched separately
            target = absolute_key(key, match.group(1))
            out.extend([target] if target in self.raw else self.children.get(target, []))
        return out

    def _combine(self, key: str) -> _Cost:
        value = self.raw.get(key)
        if not isinstance(value, str) or "${" not in value:
            return _Cost(0, len(str(value)), 0)
        work, chars, depth = len(_OPEN.findall(value)), len(value), 0
        for target in self._targets(key):
            cost = self.done.get(target, _Cost(0, 0, 0))  # a cycle: OmegaConf reports it when resolving
            work = min(work + cost.work, MAX_INTERPOLATION_WORK + 1)
            chars = min(chars + cost.chars, MAX_RESOLVED_CHARS + 1)
            depth = max(depth, cost.depth)
        return _Cost(work, chars, depth + 1)

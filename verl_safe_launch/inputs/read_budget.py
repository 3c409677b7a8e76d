"""One budget of YAML values for everything a composition reads: verl's config files, the preset, every -c file.

A YAML document is counted as it will be built (aliases at every use), before anything builds it. Outside a
composition each document has the budget to itself; inside one (``composition_budget``) every document read
draws from the same budget, so four copies of a file that is each under the limit are refused at the copy
that passes it, and a bomb in a ``--verl`` copy's own YAML is refused before Hydra reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_VALUES = 50_000
"""The most YAML values one composition may read, aliases counted at every use (verl 0.9.1's own config files
hold about 11,200; building 50,000 values into a config takes OmegaConf several seconds)."""


@dataclass
class _Budget:
    limit: int
    used: int = 0
    read: list[str] = field(default_factory=list)


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("vsl_read_budget", default=None)


@contextlib.contextmanager
def composition_budget(limit: int = MAX_VALUES) -> Iterator[None]:
    """Every YAML document read inside the block draws from one budget of ``limit`` values."""
    token = _CURRENT.set(_Budget(limit))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def values_left() -> int:
    """How many values the next document may still hold: the budget's rest, or MAX_VALUES outside one."""
    budget = _CURRENT.get()
    return MAX_VALUES if budget is None else max(budget.limit - budget.used, 0)


def charge(values: int, name: str) -> None:
    """Record that ``name`` held ``values`` values (already checked against ``values_left``)."""
    budget = _CURRENT.get()
    if budget is not None:
        budget.used += values
        budget.read.append(name)


def read_before() -> list[str]:
    """What this composition read before (for the message of the document that passes the budget)."""
    budget = _CURRENT.get()
    return list(budget.read) if budget is not None else []


__all__ = ["MAX_VALUES", "charge", "composition_budget", "read_before", "values_left"]

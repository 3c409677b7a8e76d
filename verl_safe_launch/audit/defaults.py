"""Defaults that changed since a launch's release, each with the override that keeps the old behaviour."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from verl_safe_launch.audit.aliases import ALIASES
from verl_safe_launch.audit.history import RELEASES, history
from verl_safe_launch.audit.upgrade import (
    REMOVED,
    Change,
    _legacy,
    _newer,
    current_key,
    moves_after,
    override_value,
    token_key,
)
from verl_safe_launch.compose import compose
from verl_safe_launch.config_view import format_value
from verl_safe_launch.inputs import ComposeRequest, OverrideToken

# Behaviour that changed with no key to compare in the older release: (key, release, old value, why).
NEW_DEFAULTS: tuple[tuple[str, str, object, str], ...] = (
    (
        "trainer.use_v1",
        "0.9",
        False,
        "verl 0.9 runs the V1 trainer by default; the launch ran the legacy trainer",
    ),
)


def default_changes(
    tokens: Sequence[OverrideToken],
    source: str,
    installed: Mapping[str, object],
    used: Callable[[str], bool] = lambda key: True,
) -> list[Change]:
    """Defaults that changed since ``source`` for keys the launch leaves unset and the run uses: reported,
    each with the override that keeps the old behaviour (old keys followed to their current name)."""
    set_keys = {token_key(t.text)[1] for t in tokens}
    moves = moves_after(source)
    changes: list[Change] = []
    olds = _effective_olds(history(RELEASES[source]))
    olds.update({k: v for k, since, v, _ in NEW_DEFAULTS if _newer(since, source) and k not in olds})
    for key, old in olds.items():
        current = current_key(key, moves, installed)
        if current != key and (current in olds or current.endswith("_per_gpu") != key.endswith("_per_gpu")):
            continue  # the release had the new key too (its default counted), or the old one was a global size
        if current in set_keys or current not in installed or not used(current) or _legacy(current):
            continue
        new = installed[current]
        if (
            _same(old, new)
            or key.endswith("._target_")
            or any(r.key == key and r.value == old for r in REMOVED)
        ):
            continue
        why = next((w for k, _, _, w in NEW_DEFAULTS if k == key), "the run behaves differently")
        detail = f"default {format_value(old)} in verl {source}, {format_value(new)} now: {why}"
        changes.append(Change("default", current, detail, None, current, f"{current}={override_value(old)}"))
    return changes


def _effective_olds(defaults: Mapping[str, object]) -> dict[str, object]:
    """The release's defaults, a new spelling left null read through its deprecated spelling (``lr_scheduler_type``
    null meant ``warmup_style`` decided)."""
    olds = dict(defaults)
    for alias in ALIASES:
        if (
            olds.get(alias.new, 0) is None
            and olds.get(alias.old) is not None
            and alias.fix == "{new}={value}"
        ):
            olds[alias.new] = olds[alias.old]
    return olds


def _same(old: object, new: object) -> bool:
    """True when there is no behaviour change to report (equal, interpolated, mandatory, or a whole node)."""
    return (
        old == new
        or _numeric(old) == _numeric(new) is not None
        or _interpolated(old)
        or _interpolated(new)
        or "???" in (old, new)
        or isinstance(old, dict | list)
    )


def _numeric(value: object) -> float | None:
    """A number, or a string YAML 1.1 left unread (``1e-6``), as a float; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _interpolated(value: object) -> bool:
    return isinstance(value, str) and "${" in value


def installed_defaults() -> dict[str, object]:
    """The installed verl's defaults, flattened (what an upgraded or fixed launch is composed against)."""
    view = compose(ComposeRequest()).view
    return {key: view.get(key) for key in view.keys()}  # noqa: SIM118 (a view, not a dict)

"""Which verl release a launch was written for, from what each release has and what it lacks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_safe_launch.audit.history import RELEASES, history

OPTIONAL_SECTIONS = ("reward_model.", "reward.")
"""Sections whose mandatory keys are mandatory only when the section is switched on (a reward model)."""


MAX_SPAN = 2
"""The most series steps between the oldest and newest fitting release that still count as a detection."""


@dataclass(frozen=True)
class Detection:
    """The release series a launch fits, how sure that is, and the evidence in words."""

    series: str
    oldest: str
    newest: str
    weak: bool
    why: str


@dataclass(frozen=True)
class Evidence:
    """The overrides of a launch as detection reads them."""

    keys: tuple[str, ...]
    """Keys set plainly (``key=value``, ``++key=value``)."""
    appended: tuple[str, ...]
    """Keys appended with a single ``+``: Hydra refuses that for a key the release already has."""
    maybe_set: frozenset[str] = frozenset()
    """Keys an unread part of the launch could set."""


def _keys_of(series: str, installed: Mapping[str, object]) -> Mapping[str, object]:
    keys = history(RELEASES[series])
    return {**keys, **installed} if series == max(RELEASES, key=_order) else keys


def _order(series: str) -> tuple[int, ...]:
    return tuple(int(p) for p in series.split("."))


def _conflicts(
    series: str, evidence: Evidence, verl_keys: set[str], installed: Mapping[str, object]
) -> list[str]:
    """What in the launch this release could not have run: a key it lacks, a '+' on a key it has, a mandatory key
    left unset."""
    known = _keys_of(series, installed)
    out = [f"{k} is not a key of verl {series}" for k in evidence.keys if k in verl_keys and k not in known]
    out += [f"+{k} fails on verl {series}, which has {k}" for k in evidence.appended if k in known]
    set_keys = {*evidence.keys, *evidence.appended, *evidence.maybe_set}
    out += [
        f"{k} is mandatory in verl {series} and the launch leaves it unset"
        for k, v in history(RELEASES[series]).items()
        if v == "???" and k not in set_keys and not k.startswith(OPTIONAL_SECTIONS)
    ]
    return out


def detect(evidence: Evidence, installed: Mapping[str, object]) -> Detection:
    """The releases a launch fits: each must have every verl key set plainly, lack every key appended with '+',
    and have no mandatory key left unset. More than three adjacent series fitting is weak evidence; otherwise the
    oldest that fits is chosen, so that no move or default change since is missed."""
    ordered = sorted(RELEASES, key=_order)
    verl_keys = {k for s in ordered for k in _keys_of(s, installed)}
    used = [k for k in (*evidence.keys, *evidence.appended) if k in verl_keys]
    if not used:
        return Detection(ordered[-1], ordered[0], ordered[-1], True, "no key of any verl release is set")
    conflicts = {s: _conflicts(s, evidence, verl_keys, installed) for s in ordered}
    fewest = min(len(c) for c in conflicts.values())
    fit = [s for s in ordered if len(conflicts[s]) == fewest]
    oldest, newest = fit[0], fit[-1]
    span = ordered.index(newest) - ordered.index(oldest)
    weak = fewest > 0 or span > MAX_SPAN or fit != ordered[ordered.index(oldest) : ordered.index(newest) + 1]
    return Detection(oldest, oldest, newest, weak, _why(oldest, newest, fewest, conflicts, len(set(used))))


def _why(oldest: str, newest: str, fewest: int, conflicts: Mapping[str, list[str]], count: int) -> str:
    fits = f"verl {oldest}" if oldest == newest else f"verl {oldest} to {newest}"
    if fewest:
        example = conflicts[oldest][0]
        return (
            f"no release fits all {count} verl keys; {fits} fit best ({fewest} conflict(s), e.g. {example})"
        )
    return f"its {count} verl keys fit {fits} and no other release"


def fits_text(found: Detection) -> str:
    """``0.3`` or ``0.3 to 0.5``."""
    return found.oldest if found.oldest == found.newest else f"{found.oldest} to {found.newest}"


def evidence_of(texts: Sequence[str], maybe_set: frozenset[str] = frozenset()) -> Evidence:
    """Read override texts (``key=value``, ``+key=value``, ``++key=value``, ``~key``) as detection evidence."""
    keys: list[str] = []
    appended: list[str] = []
    for text in texts:
        if text.startswith("~"):
            continue
        stripped = text.lstrip("+")
        key = stripped.partition("=")[0].strip()
        if len(text) - len(stripped) == 1:
            appended.append(key)
        else:
            keys.append(key)
    return Evidence(tuple(keys), tuple(appended), maybe_set)

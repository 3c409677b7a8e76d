"""Which verl release a launch was written for, from what each release has and what it lacks, each key weighed by
when upstream added or removed it.

A key upstream added later is weak evidence against an older release: projects vendored an old verl and copied
newer keys into it (``trainer.val_before_train``, ``clip_ratio_low``, ``filter_groups``), so such a key is named as
the project's (a fork key) rather than taken to date the launch. A key upstream had removed, a ``+key`` on a key the
release has (Hydra refuses it) and a mandatory key left unset are strong evidence.

The keys give a range of releases. Where it is wide, a setting of the engine's era the script exports (``ERAS``)
narrows it; where it spans three releases, the middle one is read, within one release of each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_safe_launch.audit.history import INSTALLED_SERIES, RELEASES, history

OPTIONAL_SECTIONS = ("reward_model.", "reward.")
"""Sections whose mandatory keys are mandatory only when the section is switched on (a reward model)."""

MAX_SPAN = 2
"""The most series steps between the oldest and newest fitting release that still count as a detection."""
LATE = 1
"""Cost of a key upstream added after the release: the project may have copied it (a fork key)."""
STRONG = 4
"""Cost of a key upstream had removed by the release, a ``+key`` the release refuses, a mandatory key unset."""
HANDFUL = (10, 2, 0.1)
"""Fork keys a release may lack and still fit: none in a launch of fewer than 10 verl keys, else 2 or a tenth of
them, whichever is more."""
FORK_GAP = 2
"""A key counts as a fork key of a release only when upstream added it at least this many series later: a key of
the very next release dates the launch instead."""


@dataclass(frozen=True)
class Era:
    """An exported setting verl's own example scripts carried up to a release and dropped after it: a launch that
    still exports it was written for that release or an older one."""

    name: str
    value: str
    last: str
    why: str


ERAS: tuple[Era, ...] = (
    Era(
        "VLLM_ATTENTION_BACKEND",
        "XFORMERS",
        "0.4",
        "the vLLM attention backend verl's examples exported up to 0.4 (20-42% of their scripts from 0.2 to 0.4.1, "
        "3 of 124 in 0.5.0, at most 2.5% in later releases)",
    ),
)
"""Settings of an engine's era. The shares are counted over the example scripts of each verl tag (v0.2 to
v0.9.0); ``bench/upgrade_projects.py --eras TAGS_DIR`` counts them again from the tags' examples."""


@dataclass(frozen=True)
class Detection:
    """The release series a launch fits, how sure that is, and the evidence in words."""

    series: str
    oldest: str
    newest: str
    weak: bool
    why: str
    fork_keys: tuple[str, ...] = ()
    """Keys the chosen release lacks that upstream added later: the project's copy had them."""

    acceptable: tuple[str, ...] = ()
    """The releases nothing in the launch contradicts (empty: none)."""

    def asked(self) -> tuple[str, ...]:
        """The releases to offer ``--from``: the acceptable ones (all older ones when none is), the installed
        series left out."""
        offered = tuple(s for s in self.acceptable if s != INSTALLED_SERIES)
        return offered or tuple(s for s in sorted(RELEASES, key=_order) if s != INSTALLED_SERIES)


@dataclass(frozen=True)
class Evidence:
    """The overrides of a launch as detection reads them."""

    keys: tuple[str, ...]
    """Keys set plainly (``key=value``, ``++key=value``)."""
    appended: tuple[str, ...]
    """Keys appended with a single ``+``: Hydra refuses that for a key the release already has."""
    maybe_set: frozenset[str] = frozenset()
    """Keys an unread part of the launch could set."""
    exports: tuple[tuple[str, str], ...] = ()
    """Variables the script exports before the launch (name, value): settings of an engine's era (``ERAS``)."""


def _keys_of(series: str, installed: Mapping[str, object]) -> Mapping[str, object]:
    keys = history(RELEASES[series])
    return {**keys, **installed} if series == max(RELEASES, key=_order) else keys


def _order(series: str) -> tuple[int, ...]:
    return tuple(int(p) for p in series.split("."))


@dataclass(frozen=True)
class _Conflict:
    cost: int
    text: str
    fork_key: str | None = None
    gap: int = 0
    """For a key upstream added later: how many series later."""


def _conflicts(
    series: str, evidence: Evidence, lifetimes: Mapping[str, list[str]], installed: Mapping[str, object]
) -> list[_Conflict]:
    """What in the launch this release could not have run, each weighed."""
    known = _keys_of(series, installed)
    out: list[_Conflict] = []
    for key in dict.fromkeys(evidence.keys):
        life = lifetimes.get(key)
        if not life or key in known:
            continue
        if _order(series) < _order(life[0]):
            text = f"{key} is a key of verl {life[0]} and later (a project on {series} may have copied it)"
            gap = sorted(RELEASES, key=_order).index(life[0]) - sorted(RELEASES, key=_order).index(series)
            out.append(_Conflict(LATE, text, key, gap))
        else:
            out.append(
                _Conflict(STRONG, f"{key} is not a key of verl {series} (verl {life[-1]} had it last)")
            )
    for key in dict.fromkeys(evidence.appended):
        if key in known:
            out.append(_Conflict(STRONG, f"+{key} fails on verl {series}, which has {key}"))
    set_keys = {*evidence.keys, *evidence.appended, *evidence.maybe_set}
    for key, value in history(RELEASES[series]).items():
        if value == "???" and key not in set_keys and not key.startswith(OPTIONAL_SECTIONS):
            out.append(
                _Conflict(STRONG, f"{key} is mandatory in verl {series} and the launch leaves it unset")
            )
    return out


def detect(evidence: Evidence, installed: Mapping[str, object]) -> Detection:
    """The release a launch was written for.

    A release is acceptable when nothing in the launch contradicts it (no strong conflict) and at most a handful
    of its keys came to upstream later (fork keys: ``HANDFUL``). An era setting the launch exports (``ERAS``)
    drops the acceptable releases after its era. Of two adjacent releases the older is chosen, so that no move or
    default change since is missed; of three, the middle one, which is within one release of each (forks taken
    from verl 0.6 use only keys verl 0.4 had, so their keys fit 0.4 to 0.6, and older forks fit 0.4 to 0.6 too).
    Weak (the caller asks for ``--from``) when the acceptable releases span more than ``MAX_SPAN`` steps or are
    not adjacent, or when none is acceptable.
    """
    ordered = sorted(RELEASES, key=_order)
    lifetimes: dict[str, list[str]] = {}
    for series in ordered:
        for key in _keys_of(series, installed):
            lifetimes.setdefault(key, []).append(series)
    used = {k for k in (*evidence.keys, *evidence.appended) if k in lifetimes}
    if not used:
        return Detection(ordered[-1], ordered[0], ordered[-1], True, "no key of any verl release is set")
    conflicts = {s: _conflicts(s, evidence, lifetimes, installed) for s in ordered}
    smallest, floor, share = HANDFUL
    handful = 0 if len(used) < smallest else max(int(floor), int(share * len(used)))
    acceptable = [
        s
        for s in ordered
        if all(c.fork_key and c.gap >= FORK_GAP for c in conflicts[s]) and len(conflicts[s]) <= handful
    ]
    if not acceptable:
        weight = {s: sum(c.cost for c in conflicts[s]) for s in ordered}
        least = min(ordered, key=lambda s: weight[s])
        worst = sorted(conflicts[least], key=lambda c: -c.cost)[0].text
        why = f"no release has all its {len(used)} verl keys and accepts all its overrides (e.g. {worst})"
        return Detection(least, least, least, True, why)
    era = _era(evidence, acceptable)
    if era is not None:
        acceptable = [s for s in acceptable if _order(s) <= _order(era.last)]
    oldest, newest = acceptable[0], acceptable[-1]
    span = ordered.index(newest) - ordered.index(oldest)
    weak = span > MAX_SPAN or acceptable != ordered[ordered.index(oldest) : ordered.index(newest) + 1]
    series = acceptable[len(acceptable) // 2] if span == MAX_SPAN else oldest
    fork = tuple(c.fork_key for c in conflicts[series] if c.fork_key)
    why = _why(oldest, newest, conflicts[series], len(used))
    if era is not None:
        why += f"; {era.name}={era.value} dates it to verl {era.last} or older ({era.why})"
    if not weak and series != oldest:
        why += f"; read as {series}, within one release of each"
    return Detection(series, oldest, newest, weak, why, fork, tuple(acceptable))


def _era(evidence: Evidence, acceptable: Sequence[str]) -> Era | None:
    """The era setting the launch exports that narrows its acceptable releases (None: none applies)."""
    exported = {name: value for name, value in evidence.exports}
    for era in ERAS:
        if exported.get(era.name, "").strip().upper() != era.value:
            continue
        if any(_order(s) > _order(era.last) for s in acceptable) and _order(acceptable[0]) <= _order(
            era.last
        ):
            return era
    return None


def _why(oldest: str, newest: str, conflicts: Sequence[_Conflict], count: int) -> str:
    fits = f"verl {oldest}" if oldest == newest else f"verl {oldest} to {newest}"
    forks = [c.fork_key for c in conflicts if c.fork_key]
    if forks:
        keys = ", ".join(forks[:3]) + (f" and {len(forks) - 3} more" if len(forks) > 3 else "")
        return f"its {count} verl keys fit {fits} best; {keys} came to upstream verl later (fork keys)"
    return f"its {count} verl keys fit {fits} and no other release"


def fits_text(found: Detection) -> str:
    """``0.3`` or ``0.3 to 0.5``."""
    return found.oldest if found.oldest == found.newest else f"{found.oldest} to {found.newest}"


def evidence_of(
    texts: Sequence[str],
    maybe_set: frozenset[str] = frozenset(),
    exports: Sequence[tuple[str, str]] = (),
) -> Evidence:
    """Read override texts (``key=value``, ``+key=value``, ``++key=value``, ``~key``) and the variables the script
    exports as detection evidence."""
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
    return Evidence(tuple(keys), tuple(appended), maybe_set, tuple(exports))

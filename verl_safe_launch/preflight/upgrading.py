"""Upgrading a launch written for an older verl: which run it was (the project's own verl copy, its pin, or the
release its keys fit), the launch rewritten for the installed verl, and every behaviour that changes, each with
advice that was judged before it is shown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from verl_safe_launch.audit import (
    ACTOR_SP,
    CRITIC_SP,
    GPUS_KEYS,
    INSTALLED_SERIES,
    RELEASES,
    Change,
    OldDefaults,
    Unread,
    behaviour_changes,
    detect,
    equivalent_values,
    evidence_of,
    fork_only,
    fork_tokens,
    history,
    installed_defaults,
    lone_group,
    old_run,
    plan_upgrade,
    project_changes,
    project_defaults,
    project_keys,
    read_layout,
    release_defaults,
    runtime_refusal,
    token_key,
    unread_because,
)
from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.config_view import format_value
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import OverrideToken, own_verl, read_version, version_tuple
from verl_safe_launch.preflight.advice import verify_advice
from verl_safe_launch.shell import ScriptLaunch, override_key


@dataclass(frozen=True)
class UpgradeReport:
    """An upgraded launch: the release it was written for and how that was found, the launch for the installed
    verl and its composition, and every line of the report."""

    source: str
    detected: str
    fits: tuple[str, str]
    launch: ScriptLaunch
    composed: Composed
    changes: tuple[Change, ...]


def unreadable_keys(launch: ScriptLaunch) -> dict[str, str]:
    """Keys the per-GPU conversions need that a part of the launch that was not read could set, and why."""
    unread = Unread.of(launch)
    set_keys = {override_key(t.text) for t in launch.tokens}
    out: dict[str, str] = {}
    for key in (*GPUS_KEYS, *ACTOR_SP, *CRITIC_SP):
        part = unread.supplier(key)
        if part is not None:
            out[key] = f"line {part.line} ({part.raw}) depends on {part.detail}"
        elif launch.passthrough is not None and key in GPUS_KEYS and key not in set_keys:
            out[key] = f'the script passes its own arguments to verl ("$@" on line {launch.passthrough.line})'
    return out


@dataclass(frozen=True)
class OldRun:
    """What the launch ran with: the defaults, how they were found, the releases that fit, fork keys."""

    defaults: OldDefaults
    detected: str
    fits: tuple[str, str]
    fork_keys: tuple[str, ...] = ()


def _shown(path: Path) -> str:
    """A path as the report shows it: relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def old_run_of(wanted: str, path: Path, launch: ScriptLaunch, installed: Mapping[str, object]) -> OldRun:
    """``--from`` when given; else the project's vendored copy (its own defaults) or pin; else the release the
    launch's keys fit, or a usage error naming the releases that fit when they do not pin one down."""
    if wanted != "auto":
        return OldRun(release_defaults(wanted, f"--from {wanted}"), f"--from {wanted}", (wanted, wanted))
    found = own_verl(path, [(e.name, e.value) for e in launch.exports])
    if found is not None and found.package is not None:
        old = project_defaults(found.package, read_version(found.package), found.how)
        return OldRun(old, old.why, (old.series, old.series))
    if found is not None and found.pinned is not None:
        series = ".".join(found.pinned.split(".")[:2])
        if series in RELEASES:
            return OldRun(release_defaults(series, found.how), found.how, (series, series))
    maybe = frozenset(s for p in Unread.of(launch).parts for s in (p.supplies or ()))
    exports = [(e.name, e.value) for e in launch.exports]
    detection = detect(evidence_of([t.text for t in launch.tokens], maybe, exports), installed)
    if detection.weak:
        asked = detection.asked()
        raise UsageError(
            f"cannot tell which verl release {launch.path} was written for: {detection.why}",
            where="--from auto",
            fix=f"pass the release it was written for: --from {{{','.join(asked)}}}",
        )
    oldest = (
        "; upgraded from the oldest, so no change is missed"
        if detection.series == detection.oldest != detection.newest
        else ""
    )
    detected = f"detected: {detection.why}{oldest}"
    old = release_defaults(detection.series, detected)
    return OldRun(old, detected, (detection.oldest, detection.newest), detection.fork_keys)


def upgrade_launch(path: Path, launch: ScriptLaunch, wanted: str, gpus: int | None) -> UpgradeReport:
    """The launch rewritten for the installed verl, with every line of the report."""
    installed = installed_defaults()
    run = old_run_of(wanted, path, launch, installed)
    old, source = run.defaults, run.defaults.series
    layout = read_layout(launch.tokens, old.defaults, unreadable_keys(launch), gpus)
    set_keys = [token_key(t.text)[1] for t in launch.tokens]
    planned = plan_upgrade(
        fork_tokens(old, set_keys), source, run.detected, installed, layout, whole_launch=False
    )
    forks, gone = _known(planned.tokens, installed), _gone(planned.tokens, installed, old)
    plan = plan_upgrade(launch.tokens, source, run.detected, installed, layout)
    upgraded = replace(launch, tokens=(*forks, *plan.tokens))
    composed = compose(upgraded.request(lenient=True))
    kept, dropped, notes = _kept(old, forks, composed, installed)
    if dropped:
        upgraded = replace(launch, tokens=(*[t for t in forks if t not in dropped], *plan.tokens))
        composed = compose(upgraded.request(lenient=True))
    project = project_keys(plan.tokens, installed)
    unknown = [
        Change("unknown", r.key, f"{r.reason} (a key of verl 0.9.1's history)", r.token.source.line)
        for r in composed.rejected
        if r.key not in {k for k, _, _ in project}
    ]
    lines = [*plan.changes, *kept, *notes, *gone]
    lines += _fork_notes(old, run.fork_keys, set_keys, source)
    lines += [*project_changes(project), *lone_group(composed.view, project), *unknown]
    lines += _unread(plan.tokens, composed, {k for c in lines for k in (c.key, c.new_key) if k})
    covered = {k for c in lines for k in (c.key, c.new_key) if k}
    before = old_run(old, launch.tokens)
    behaviour = behaviour_changes(before, composed.view, source, covered, installed)
    lines += verify_advice(upgraded, composed, behaviour)
    listed = {*covered, *(k for c in behaviour for k in (c.key, c.new_key) if k)}
    lines += _in_range(run, launch, composed, listed, installed)
    return UpgradeReport(source, run.detected, run.fits, upgraded, composed, tuple(lines))


def _in_range(
    run: OldRun, launch: ScriptLaunch, composed: Composed, covered: set[str], installed: Mapping[str, object]
) -> list[Change]:
    """When a lone launch was read as one of several releases its keys fit, what else changes had it run on each
    of the others: one line per value that release had and the upgraded run changes, not already listed."""
    ordered = sorted(RELEASES, key=version_tuple)
    oldest, newest = (ordered.index(s) for s in run.fits)
    lines: list[Change] = []
    for other in ordered[oldest : newest + 1]:
        if other == run.defaults.series:
            continue
        before = old_run(release_defaults(other, f"if written for verl {other}"), launch.tokens)
        for c in behaviour_changes(before, composed.view, other, covered, installed):
            covered.update(k for k in (c.key, c.new_key) if k)
            detail = (
                f"the launch's keys fit verl {other} too; had it run on verl {other}: {c.detail}; --from {other} "
                "lists it with the override that keeps it"
            )
            lines.append(Change("range", c.key, detail, c.line, c.new_key))
    return lines


def _kept(
    old: OldDefaults, tokens: Sequence[OverrideToken], composed: Composed, installed: Mapping[str, object]
) -> tuple[list[Change], list[OverrideToken], list[Change]]:
    """The project's changed defaults the upgraded run keeps (one line each), those left out (verl 0.9.1 reads them
    alike, does not read them, or refuses them) and lines for the refused."""
    kept: list[Change] = []
    dropped: list[OverrideToken] = []
    notes: list[Change] = []
    view = composed.view
    for token in tokens:
        _, key, _ = token_key(token.text)
        origin = (token.source.raw or "").partition(":")[0]
        value = view.get(key)
        where = f"{_shown(old.file) if old.file else ''}:{token.source.line}"
        said = f"the project's verl sets {origin}: {format_value(value)} ({where}); upstream verl {old.series} has "
        said += format_value(old.upstream[origin]) if origin in old.upstream else "no such key"
        refusal = runtime_refusal(key, value, view)
        if equivalent_values(key, installed.get(key), value, view) or unread_because(key, view):
            dropped.append(token)
        elif refusal is not None:
            dropped.append(token)
            notes.append(Change("refused", origin, f"{said}; it cannot be kept: {refusal}", None, key))
        else:
            kept.append(Change("kept", origin, f"{said}: kept, so the run does what it did", None, key))
    return kept, dropped, notes


def _unread(tokens: Sequence[OverrideToken], composed: Composed, covered: set[str]) -> list[Change]:
    """A line for each override the upgraded run does not read (and no other line explains)."""
    out = []
    for token in tokens:
        _, key, value = token_key(token.text)
        why = unread_because(key, composed.view) if key in composed.view and key not in covered else None
        if why is not None:
            detail = f"{key}={value}: verl 0.9.1 does not read it in this run ({why})"
            out.append(Change("unread", key, detail, token.source.line))
    return out


def _known(tokens: Sequence[OverrideToken], installed: Mapping[str, object]) -> tuple[OverrideToken, ...]:
    """The project's changed defaults whose key verl 0.9.1 has (after the upgrade moved them)."""
    return tuple(t for t in tokens if token_key(t.text)[1] in installed)


def _gone(tokens: Sequence[OverrideToken], installed: Mapping[str, object], old: OldDefaults) -> list[Change]:
    """A line for each changed default of the project whose key verl 0.9.1 does not have."""
    out = []
    for token in tokens:
        _, key, value = token_key(token.text)
        if key in installed:
            continue
        origin = (token.source.raw or key).partition(":")[0]
        last = next((s for s in reversed(RELEASES) if origin in history(RELEASES[s])), None)
        had = f"upstream verl had it up to {last}" if last else "no upstream release has it"
        detail = (
            f"the project's verl sets {origin}={value} ({_shown(old.file) if old.file else ''}:"
            f"{token.source.line}); verl 0.9.1 has no such key "
            f"({had}): whatever it did is not carried over"
        )
        out.append(Change("removed", origin, detail, None))
    return out


def _fork_notes(
    old: OldDefaults, fork_keys: Sequence[str], set_keys: Sequence[str], source: str
) -> list[Change]:
    """The project's own keys: those of its copy the launch leaves at their defaults (one line), and keys a
    launch without a copy sets that upstream added after the release it was written for."""
    out = []
    own = [k for k in fork_only(old) if k not in set_keys]
    if own:
        shown = ", ".join(own[:6]) + (f" and {len(own) - 6} more" if len(own) > 6 else "")
        detail = (
            f"the project's verl ({_shown(old.file) if old.file else ''}) has {len(own)} "
            f"{'key' if len(own) == 1 else 'keys'} of its own that the launch leaves at their "
            f"defaults ({shown}); verl 0.9.1 reads none of them: whatever they did is the project's code to carry"
        )
        out.append(Change("project", "", detail))
    for key in fork_keys:
        first = next((s for s in RELEASES if key in history(RELEASES[s])), INSTALLED_SERIES)
        detail = (
            f"a key of verl {first} and later that the project's verl {source} had as its own (projects copied "
            "it into their vendored verl); verl 0.9.1 reads it, so its value is kept"
        )
        out.append(Change("project", key, detail))
    return out

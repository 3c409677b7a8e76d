"""A verdict only as strong as what was read: findings an unread part of a script could change become "cannot verify"."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

from verl_safe_launch.audit.settle import settle_command
from verl_safe_launch.compose import config_groups
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import OverrideToken
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell import ScriptLaunch, ScriptNote, override_key

CANNOT_VERIFY = "cannot-verify"
STRUCTURE_RULES = frozenset(
    {"unknown-key", "new-key", "dataclass-field", "ignored-key", "deprecated-key", "engine-mismatch"}
)
"""Rules about which keys exist: another config group (``model_engine=megatron``) changes their answer."""
REFUSALS = frozenset({"unknown-key", "new-key", "dataclass-field"})
"""Overrides Hydra or a verl dataclass refuses: written out in full, they may stay refused whatever config group an
unread word chooses (``Everywhere`` asks)."""
Everywhere = Callable[[Finding], bool]
"""Whether a finding holds in every config group an unread word could choose."""


@dataclass(frozen=True)
class Unread:
    """The parts of one launch the reader could not read, and the overrides it did read (in order)."""

    parts: tuple[ScriptNote, ...]
    last_write: dict[str, int]

    @classmethod
    def of(cls, launch: ScriptLaunch) -> Unread:
        """The unread parts of a launch, with the position of the last override of every key."""
        last: dict[str, int] = {}
        for position, token in enumerate(launch.tokens):
            key = override_key(token.text)
            if key is not None:
                last[key] = position
        return cls(tuple(n for n in launch.notes if n.unread), last)

    def supplier(self, key: str) -> ScriptNote | None:
        """The first unread part that could set ``key`` (or a node above or below it) after its last override."""
        for part in self.parts:
            if self.pinned(key, part):
                continue
            if part.supplies is None or any(_related(key, supplied) for supplied in part.supplies):
                return part
        return None

    def supplier_of(self, finding: Finding) -> ScriptNote | None:
        """The unread part that could set one of the finding's keys itself (not only a config group)."""
        for key in depends_on(finding):
            for part in self.parts:
                supplies = part.supplies or ()
                if not self.pinned(key, part) and any(_related(key, supplied) for supplied in supplies):
                    return part
        return None

    def without(self, part: ScriptNote | None) -> Unread:
        """The same, with ``part`` read (its key refused whatever its value)."""
        return (
            self if part is None else Unread(tuple(p for p in self.parts if p is not part), self.last_write)
        )

    def pinned(self, key: str, part: ScriptNote) -> bool:
        """True when an override of ``key`` comes after ``part`` (Hydra keeps the last value)."""
        return self.last_write.get(key, -1) >= part.position

    def changes(self, finding: Finding, structural: ScriptNote | None) -> ScriptNote | None:
        """The unread part that could change the finding, if any."""
        keys = depends_on(finding)
        for key in keys:
            part = self.supplier(key)
            if part is not None:
                return part
        if structural is None:
            return None
        if finding.rule_id not in STRUCTURE_RULES and keys and all(self.pinned(k, structural) for k in keys):
            return None
        return structural

    def structural(self) -> ScriptNote | None:
        """An unread part that could choose a config group (``model_engine=...``): every key may change."""
        for group in config_groups():
            for part in self.parts:
                if self.pinned(group, part):
                    continue
                if part.supplies is None or any(_chooses(group, key) for key in part.supplies):
                    return part
        return None


def _chooses(group: str, supplied: str) -> bool:
    """An unread value of ``supplied`` chooses ``group`` only when it is the group or a node above it.

    ``data.train_files="$X"`` changes that one value, never which config ``data`` is composed from.
    """
    return group == supplied or group.startswith(supplied + ".")


def _related(key: str, supplied: str) -> bool:
    return key == supplied or key.startswith(supplied + ".") or supplied.startswith(key + ".")


def depends_on(finding: Finding) -> tuple[str, ...]:
    """The keys a finding depends on: the keys it names and the keys of the values it cites."""
    keys = [k for k in finding.keys if k and not k.startswith("$")]
    keys.extend(key for key, _value, _source in finding.sources if key and not key.startswith("$"))
    keys.extend(finding.reads)
    return tuple(dict.fromkeys(keys))


def qualify(
    findings: Iterable[Finding], launch: ScriptLaunch, everywhere: Everywhere | None = None
) -> list[Finding]:
    """Judge a launch's findings by what was read.

    Every error and warning that an unread part of the launch could change becomes "cannot verify"; a shared
    value replaced on the launch line itself is a warning; an explicit value emptied by an unset variable is one.
    A refused override (``REFUSALS``) that only a config-group choice could change stays when ``everywhere`` says
    it is refused in every group.
    """
    findings = [_deliberate(f, launch) for f in findings]
    unread = Unread.of(launch)
    if not unread.parts:
        return findings
    structural = unread.structural()
    out: list[Finding] = []
    for finding in findings:
        if finding.severity is Severity.INFO:
            out.append(finding)
            continue
        part = unread.without(_own_part(finding, unread)).changes(finding, structural)
        if part is structural and part is not None and _refused_everywhere(finding, part, unread, everywhere):
            part = None
        if part is not None and (held := _holds_unless(finding, part, unread, launch)) is not None:
            out.append(held)
            continue
        out.append(finding if part is None else cannot_verify(finding, part, launch))
    return [*out, *_emptied(launch)]


def _own_part(finding: Finding, unread: Unread) -> ScriptNote | None:
    """The unread ``key=$X`` a refusal is about: Hydra refuses its key whatever the value, so it changes nothing."""
    if finding.rule_id not in REFUSALS:
        return None
    for _key, _value, source in finding.sources:
        for part in unread.parts:
            if part.kind == "unresolved" and (part.line, part.raw) == (source.line, source.raw):
                return part
    return None


def _refused_everywhere(
    finding: Finding, part: ScriptNote, unread: Unread, everywhere: Everywhere | None
) -> bool:
    """A refused override no unread part writes itself, refused under every config group an unread word picks.

    An unread config file is no such word: it can add the very key the override needs.
    """
    if finding.rule_id not in REFUSALS or everywhere is None or part.kind == "config":
        return False
    return unread.supplier_of(finding) is None and everywhere(finding)


HOLDS_WHATEVER = frozenset({"duplicate-key"})
"""Findings no later override can undo: a key set twice stays set twice whatever an unread word adds."""


def _holds_unless(finding: Finding, part: ScriptNote, unread: Unread, launch: ScriptLaunch) -> Finding | None:
    """The finding as it stands when the unread part could change it only by repeating a key of the launch.

    Every key the finding depends on is written on the launch line before the part (so setting it again there is
    itself flagged as ``duplicate-key``), and no config-group choice bears on it. ``duplicate-key`` holds whatever
    the part is; any other finding says which keys the part would have to set. None when this does not apply.
    """
    keys = depends_on(finding)
    if not keys or finding.rule_id in STRUCTURE_RULES or finding.severity is Severity.INFO:
        return None
    for key in keys:
        at = unread.last_write.get(key)
        if at is None or at >= part.position:
            return None
        if (launch.tokens[at].source.line or 0) < launch.line:
            return None  # repeating a value defined before the launch line is deliberate, not an error
    if finding.rule_id in HOLDS_WHATEVER:
        return finding
    shown = " or ".join(keys)
    return replace(
        finding, message=f"{finding.message}; unless {part.raw} (line {part.line}) sets {shown} again"
    )


def _deliberate(finding: Finding, launch: ScriptLaunch) -> Finding:
    """A key defined before the launch (in an array or a variable) and replaced on the launch line: info."""
    if finding.rule_id != "duplicate-key" or finding.severity is not Severity.WARNING:
        return finding
    lines = [source.line for _key, _value, source in finding.sources]
    if None in lines or len(lines) < 2:
        return finding
    *earlier, last = (line for line in lines if line is not None)
    if not (all(line < launch.line for line in earlier) and last >= launch.line):
        return finding
    message = (
        f"{finding.message}; the launch on line {launch.line} replaces a value defined earlier in the script, "
        "which looks deliberate"
    )
    return replace(finding, severity=Severity.INFO, message=message)


def _emptied(launch: ScriptLaunch) -> list[Finding]:
    """``key=$UNSET`` after an explicit ``key=value``: unless the environment sets it, the value becomes ''."""
    out: list[Finding] = []
    for note in launch.notes:
        if note.kind != "unresolved" or not note.supplies or len(note.supplies) != 1:
            continue
        if not note.detail.endswith("which the script does not set"):
            continue
        key = note.supplies[0]
        before = [t for t in launch.tokens[: note.position] if override_key(t.text) == key]
        if before:
            out.append(_emptied_one(launch, note, key, before[-1]))
    return out


def _emptied_one(launch: ScriptLaunch, note: ScriptNote, key: str, token: OverrideToken) -> Finding:
    variable = note.detail.split(",", 1)[0]
    line = token.source.line
    message = (
        f"{token.text} (line {line}) is replaced by {note.raw} (line {note.line}); the script never sets "
        f"{variable}, so unless the environment does, Hydra gets '{key}=' and the value becomes ''"
    )
    fix = f"set {variable} in the script, or keep one of the two ({token.text})"
    here = Source(Layer.SCRIPT, launch.path, note.line, raw=note.raw)
    sources = ((key, token.text.partition("=")[2], token.source), (key, note.raw, here))
    return Finding("script-emptied-value", Severity.WARNING, (key,), message, fix, sources)


def cannot_verify(finding: Finding, part: ScriptNote, launch: ScriptLaunch) -> Finding:
    """What the finding would say, and the unread part (text and line) that could change it.

    One that would say verl fails is a warning (never info: the user must see it); a warning becomes info.
    """
    message = (
        f"cannot verify [{finding.rule_id}]: {finding.message}; line {part.line} ({part.raw}) is not read "
        f"and could change it: {part.detail}"
    )
    source = Source(Layer.SCRIPT, launch.path, part.line, raw=part.raw)
    command = settle_command(launch, (part,))
    fix = f"audit it with the value the run gets: {command}"
    sources = (*finding.sources, ("unread", part.raw, source))
    return Finding(CANNOT_VERIFY, doubtful_severity(finding), finding.keys, message, fix, sources)


def doubtful_severity(finding: Finding) -> Severity:
    """The severity of a finding an unread part could change: an error is a warning, anything else info."""
    return Severity.WARNING if finding.severity is Severity.ERROR else Severity.INFO


def deciding_parts(
    launch: ScriptLaunch, findings: Iterable[Finding], read: Collection[str]
) -> list[ScriptNote]:
    """The unread parts of a launch whose value could change its verdict: what makes it UNVERIFIED.

    A part decides when it could be any override (an unread word or array, ``supplies`` None) or a config file,
    when it could choose a config group, when a finding was narrowed to "cannot verify" because of it, or when it
    sets a key whose value a check read (``read``: the keys the pre-flight read, see ``ConfigView.recording``).
    An unread value no check reads (``trainer.experiment_name="$NAME"``) decides nothing: the verdict stays GO.
    """
    unread = Unread.of(launch)
    named = {
        (source.line, raw)
        for finding in findings
        if finding.rule_id == CANNOT_VERIFY
        for key, raw, source in finding.sources
        if key == "unread"
    }
    prefixes = {key.rsplit(".", n)[0] for key in read for n in range(1, key.count(".") + 1)}
    groups = config_groups()

    def decides(part: ScriptNote) -> bool:
        if part.supplies is None or part.kind == "config" or (part.line, part.raw) in named:
            return True
        for key in part.supplies:
            if unread.pinned(key, part):
                continue
            if key in read or key in prefixes or any(key.startswith(r + ".") for r in read):
                return True
            if any(_chooses(group, key) for group in groups):
                return True
        return False

    return [part for part in unread.parts if decides(part)]


__all__ = [
    "CANNOT_VERIFY",
    "Unread",
    "cannot_verify",
    "deciding_parts",
    "depends_on",
    "doubtful_severity",
    "qualify",
]

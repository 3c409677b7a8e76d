"""A baseline of accepted findings: keyed by (rule, script, key, value), so an edit elsewhere in a script (lines
moving, other keys changing) keeps it; only findings it does not hold fail the gate, and entries no script still
produces are reported as stale."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from verl_safe_launch.config_view import format_value
from verl_safe_launch.errors import InputError
from verl_safe_launch.files import read_text_input
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.preflight.scripts import ScriptAudit

BASELINE_SCHEMA = 1
Key = tuple[str, str, str, str]
"""(rule, script, key, value)."""


def script_key(path: str) -> str:
    """The script as a baseline names it: relative to the current directory where it lies below it."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.as_posix()


def finding_key(finding: Finding, script: str) -> Key:
    """A finding's baseline key: its rule, the script, its first key and that key's value (no line numbers)."""
    key = finding.keys[0] if finding.keys else ""
    values = [value for name, value, _source in finding.sources if name == key]
    value = format_value(values[-1]) if values else ""
    return (finding.rule_id, script, key, value)


def gated(findings: Iterable[Finding]) -> list[Finding]:
    """The findings a baseline records and a gate judges: errors and warnings."""
    return [f for f in findings if f.severity is not Severity.INFO]


@dataclass
class Baseline:
    """Accepted findings (a key may be accepted several times), and which of them this run met."""

    accepted: Counter[Key]
    met: Counter[Key] = field(default_factory=Counter)
    audited: set[str] = field(default_factory=set)

    @classmethod
    def load(cls, path: Path) -> Baseline:
        """Read a baseline file written by ``--write-baseline``."""
        text = read_text_input(path, what="baseline", missing_fix="write one with --write-baseline FILE")
        try:
            data = json.loads(text)
            entries = data["findings"]
            keys = [(e["rule"], e["script"], e["key"], e["value"]) for e in entries]
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(
                f"{path} is not a baseline file ({exc})",
                where=str(path),
                fix="write one with --write-baseline",
            ) from None
        counts = Counter({(str(r), str(s), str(k), str(v)): 0 for r, s, k, v in keys})
        for entry, key in zip(entries, keys, strict=True):
            counts[(str(key[0]), str(key[1]), str(key[2]), str(key[3]))] += int(entry.get("count", 1))
        return cls(counts)

    def apply(self, result: ScriptAudit) -> ScriptAudit:
        """The script's audit with the findings this baseline accepts moved aside (``baselined``)."""
        script = script_key(result.path)
        self.audited.add(script)
        launches = []
        for launch in result.launches:
            kept: list[Finding] = []
            accepted: list[Finding] = []
            for finding in launch.findings:
                key = finding_key(finding, script)
                if finding.severity is not Severity.INFO and self.met[key] < self.accepted[key]:
                    self.met[key] += 1
                    accepted.append(finding)
                else:
                    kept.append(finding)
            launches.append(replace(launch, findings=tuple(kept), baselined=tuple(accepted)))
        return replace(result, launches=tuple(launches))

    def stale(self) -> list[Key]:
        """Accepted findings of the audited scripts that this run did not meet (fixed since, or changed)."""
        return sorted(
            key for key, count in self.accepted.items() if key[1] in self.audited and self.met[key] < count
        )


class BaselineWriter:
    """Collects the keys of every gated finding, then writes them sorted (no line numbers, no timestamps)."""

    def __init__(self) -> None:
        self.keys: Counter[Key] = Counter()
        self.messages: dict[Key, str] = {}

    def add(self, result: ScriptAudit) -> None:
        """Record the gated findings of one script (those a baseline already accepted included)."""
        script = script_key(result.path)
        for launch in result.launches:
            for finding in gated([*launch.findings, *launch.baselined]):
                key = finding_key(finding, script)
                self.keys[key] += 1
                self.messages.setdefault(key, f"{finding.severity.value}: {finding.message}"[:200])

    def write(self, path: Path, *, force: bool) -> int:
        """Write the baseline (atomically; an existing file only with ``force``); the number of entries."""
        if path.exists() and not force:
            raise InputError(f"{path} exists", where="--write-baseline", fix="pass --force to replace it")
        entries = [
            {"rule": r, "script": s, "key": k, "value": v, "count": n, "message": self.messages[(r, s, k, v)]}
            for (r, s, k, v), n in sorted(self.keys.items())
        ]
        document = {"schema": BASELINE_SCHEMA, "tool": "verl-safe-launch", "findings": entries}
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            temp.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            os.replace(temp, path)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise InputError(f"cannot write {path}: {exc.strerror}", where="--write-baseline") from None
        return len(entries)


__all__ = ["BASELINE_SCHEMA", "Baseline", "BaselineWriter", "finding_key", "gated", "script_key"]

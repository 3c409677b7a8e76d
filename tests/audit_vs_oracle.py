"""One script's ``audit`` verdicts set beside an oracle's: what the verl the script runs says about each launch
(``runs``, ``fails``, ``compose-error``, ...), made by real bash, that verl's Hydra and its own validation.

Shared by bench/precision_corpus.py (the outside corpus) and tests/test_release_examples.py (verl's own examples).
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.preflight import Auditor

MAIN = "verl.trainer.main_ppo"
FAILS = ("fails", "compose-error")
"""Oracle summaries of a launch the verl refuses."""


@dataclass
class Compared:
    """One launch: the audit's verdict and what the verl did with it."""

    label: str
    refused: bool
    verdict: str
    """The audit's verdict; ``no-go`` also for an UNVERIFIED launch that is NO-GO audited as the oracle ran it."""
    settled_by_env: bool
    findings: tuple[Finding, ...]
    reason: str

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]


@dataclass
class ScriptComparison:
    launches: list[Compared] = field(default_factory=list)
    crash: str | None = None
    count_mismatch: bool = False
    verl: str | None = None
    """The verl the audit read (its header's first line), None when the audit crashed."""


def oracle_launches(launches: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The main_ppo launches of one script the oracle judged; None when there are none to compare, or when one
    was blocked by what the oracle's machine lacks (no vLLM, no login)."""
    expected = [launch for launch in launches if launch.get("main") == MAIN]
    if not expected or any(launch["summary"] == "env-blocked" for launch in expected):
        return None
    return expected


def compare_script(
    auditor: Auditor, script: Path, expected: list[dict[str, Any]], name: str
) -> ScriptComparison:
    """Audit one script (with the verl already chosen) and pair each launch with the oracle's verdict on it."""
    out = ScriptComparison()
    try:
        result = auditor.script(script)
    except Exception:  # a crash is what the caller counts
        out.crash = f"{name}: {traceback.format_exc().splitlines()[-1]}"
        return out
    out.verl = result.verl[0] if result.verl else "-"
    if result.error is not None:
        if any(launch["summary"] == "runs" for launch in expected):
            out.crash = f"{name}: {result.error.render().splitlines()[0]}"
        return out
    if len(result.launches) != len(expected):
        out.count_mismatch = True
        return out
    for k, (item, want) in enumerate(zip(result.launches, expected, strict=True)):
        refused = want["summary"] in FAILS
        verdict, settled = str(item.verdict), False
        if refused and verdict == "unverified" and under_oracle_env(auditor, script, k, item) == "no-go":
            # the oracle ran with the variables unset; so audited, it is NO-GO
            verdict, settled = "no-go", True
        reason = want.get("reason") or want.get("verdict") or want.get("compose_error") or ""
        out.launches.append(Compared(f"{name}#{k + 1}", refused, verdict, settled, item.findings, reason))
    return out


def under_oracle_env(auditor: Auditor, script: Path, k: int, item: Any) -> str | None:
    """The verdict of one UNVERIFIED launch audited as the oracle ran it: every environment variable the launch's
    own settle command names taken as unset (empty), which is what the oracle's bash saw; where the command says
    ``--trace`` (a command substitution, a sourced file), the script run under bash here, as the oracle ran it (this
    machine has no GPU: ``nvidia-smi`` counts none, as it did for the oracle). None when nothing is left to read."""
    from verl_safe_launch.preflight import TraceOptions

    settle = item.settle or ""
    names = re.findall(r"--env (\w+)=", settle)
    if not names and "--trace" not in settle:
        return None
    env = dict.fromkeys(names, "")
    trace = TraceOptions(env=env, timeout=60.0) if "--trace" in settle else None
    again = Auditor(job_findings=auditor.job_findings, env=env, trace=trace).script(script)
    if again.error is not None or len(again.launches) <= k:
        return None
    return str(again.launches[k].verdict)


def judged_again(launches: list[tuple[dict[str, Any], Compared]]) -> list[dict[str, Any]]:
    """The oracle's verdict, judged again now, on each launch (``script``, ``copy``, ``root`` of its script
    given beside it), one worker subprocess per copy; with that copy's worker-stage probes where the launch's
    every error is a rule whose check verl makes only after its validation (tests/script_oracle.py ``PROBES``)."""
    from script_oracle import PROBES, batch

    items = []
    for where, launch in launches:
        rules = {f.rule_id for f in launch.errors}
        probes = sorted(rules) if rules and rules <= set(PROBES) else []
        items.append({**where, "probes": probes})
    out = []
    for (_, launch), rec in zip(launches, batch(items, 1), strict=True):
        k = int(launch.label.rpartition("#")[2]) - 1
        ppo = [one for one in rec["launches"] if one["main"] == MAIN]
        out.append(ppo[k] if k < len(ppo) else {"summary": "harness-error", "error": "launch not found"})
    return out


def worker_confirmed(now: dict[str, Any], launch: Compared) -> str | None:
    """What the copy's own code raised on a launch its validation accepts, when it fails for every rule the audit
    erred on (None: some error of the audit has no failure in the copy's code behind it)."""
    rules = {f.rule_id for f in launch.errors}
    probes = now.get("probes") or {}
    failing = {r: v for r, v in probes.items() if v is not None and not v.startswith("n/a")}
    if now.get("summary") == "runs" and rules and set(failing) == rules:
        return str(next(iter(failing.values())))
    return None

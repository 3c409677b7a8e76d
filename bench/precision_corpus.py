"""Precision and recall of ``audit`` on an outside corpus: scripts judged by their own verl's Hydra and validation.

Reads oracle results (a JSON list, one entry per script: ``script``, ``copy`` (a directory holding the ``verl``
the script was written for), ``launches`` with each ``main`` and ``summary``: ``runs``, ``fails``,
``compose-error``, ``not-ppo``, ``env-blocked``), made by running each script under real bash with recorders,
composing every ``verl.trainer.main_ppo`` launch with that copy's own Hydra config and running that copy's own
validation in a subprocess. Each script is then audited statically, the verl it uses found as ``audit`` finds it
(``--which project``: vendored copy, pin, installed) or named (``--which copy``: as ``--verl COPY``).

    .venv/bin/python bench/precision_corpus.py RESULTS.json [RESULTS.json ...] [--which copy|project] [-v]

Prints, per results file: launches compared, error findings and how many are right (on a launch its verl
refuses), false NO-GO (launches that run, called NO-GO) by rule, misses (launches verl refuses that are not
NO-GO), the verl each script was checked against, and crashes.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAIN = "verl.trainer.main_ppo"
FAILS = ("fails", "compose-error")


def measure(entries: list[dict[str, Any]], which: str) -> dict[str, Any]:
    """Audit every script of one results file and compare each main_ppo launch with its oracle verdict."""
    from verl_safe_launch.backends import bringup_findings
    from verl_safe_launch.findings import Severity
    from verl_safe_launch.inputs import choose_verl
    from verl_safe_launch.preflight import Auditor

    tally: dict[str, Any] = collections.defaultdict(int)
    tally["false_nogo"], tally["missed"], tally["crashes"], tally["cross"] = [], [], [], []
    tally["by_rule"], tally["verl"] = collections.Counter(), collections.Counter()
    auditor = Auditor(job_findings=bringup_findings)
    chosen: Path | None = None
    choose_verl(None, "--verl")
    for entry in entries:
        expected = [launch for launch in entry["launches"] if launch.get("main") == MAIN]
        if not expected or any(launch["summary"] in ("env-blocked",) for launch in expected):
            continue
        copy = Path(entry["copy"]) if which == "copy" else None
        if copy != chosen:  # choosing clears every cache of the verl in use: once per copy, not per script
            choose_verl(copy, "--verl")
            chosen = copy
        try:
            result = auditor.script(Path(entry["script"]))
        except Exception:  # a crash is what this counts
            tally["crashes"].append(f"{entry['path']}: {traceback.format_exc().splitlines()[-1]}")
            continue
        tally["verl"][result.verl[0] if result.verl else "-"] += 1
        if result.error is not None:
            if any(launch["summary"] == "runs" for launch in expected):
                tally["crashes"].append(f"{entry['path']}: {result.error.render().splitlines()[0]}")
            continue
        if len(result.launches) != len(expected):
            tally["count_mismatch"] += 1
            continue
        for k, (item, want) in enumerate(zip(result.launches, expected, strict=True)):
            label = f"{entry['path']}#{k + 1}"
            fails = want["summary"] in FAILS
            tally["launches"] += 1
            errors = [f for f in item.findings if f.severity is Severity.ERROR]
            tally["errors"] += len(errors)
            _suggestions(tally, item.findings)
            tally["right"] += len(errors) if fails else 0
            if fails:
                tally["refused"] += 1
                verdict = item.verdict
                if verdict == "unverified" and _under_oracle_env(auditor, entry, k, item) == "no-go":
                    verdict = "no-go"  # the oracle ran with the variables unset; so audited, it is NO-GO
                    tally["settled_by_env"] += 1
                tally["refused_nogo"] += verdict == "no-go"
                if verdict != "no-go":
                    why = want.get("verdict") or want.get("compose_error") or ""
                    tally["missed"].append(f"{label} ({item.verdict}): {why[:120]}")
            elif item.verdict == "no-go":
                rules = sorted({f.rule_id for f in errors})
                tally["by_rule"].update(rules)
                first = errors[0].message[:140] if errors else ""
                tally["false_nogo"].append(f"{label}: {rules} {first}")
    choose_verl(None)
    return tally


def _under_oracle_env(auditor: Any, entry: dict[str, Any], k: int, item: Any) -> str | None:
    """The verdict of one UNVERIFIED launch audited as the oracle ran it: every environment variable the launch's
    own settle command names taken as unset (empty), which is what the oracle's bash saw. None when the launch
    does not wait on the environment alone (a sourced file, a command substitution: those need ``--trace``)."""
    import re

    from verl_safe_launch.preflight import Auditor

    settle = item.settle or ""
    if "--trace" in settle:
        return None
    names = re.findall(r"--env (\w+)=", settle)
    if not names:
        return None
    again = Auditor(job_findings=auditor.job_findings, env=dict.fromkeys(names, "")).script(
        Path(entry["script"])
    )
    if again.error is not None or len(again.launches) <= k:
        return None
    return str(again.launches[k].verdict)


def _suggestions(tally: dict[str, Any], findings: Any) -> None:
    """Unknown keys, headlines that name another verl, and did-you-mean fixes that cross meanings."""
    import re

    from verl_safe_launch.inputs import is_typo

    for finding in findings:
        if finding.rule_id != "unknown-key":
            continue
        tally["unknown_keys"] += len(finding.keys)
        tally["headlines"] += "was written for" in finding.message
        match = re.search(r"did you mean (\S+)\?", finding.fix or "")
        if match:
            tally["did_you_mean"] += 1
            old, new = finding.keys[0].rpartition(".")[2], match.group(1).rpartition(".")[2]
            if old != new and not is_typo(old, new):
                tally["did_you_mean_cross"] += 1
                tally["cross"].append(f"{finding.keys[0]} -> {match.group(1)}")


def report(name: str, tally: dict[str, Any], seconds: float, verbose: bool) -> None:
    errors, right = tally["errors"], tally["right"]
    precision = right / errors if errors else 1.0
    recall = tally["refused_nogo"] / tally["refused"] if tally["refused"] else 1.0
    copies = dict(tally["verl"]) if len(tally["verl"]) <= 4 else f"{len(tally['verl'])} copies of verl"
    print(f"== {name}: {tally['launches']} launches ({seconds:.0f} s), checked against {copies}")
    print(f"  error findings {errors}, right {right}, error precision {precision:.1%}")
    print(f"  false NO-GO {len(tally['false_nogo'])} by rule {dict(tally['by_rule'])}")
    print(
        f"  refused by verl {tally['refused']}, NO-GO {tally['refused_nogo']} ({tally['settled_by_env']} of them "
        f"UNVERIFIED and NO-GO once audited with the oracle's unset variables), recall {recall:.1%}"
    )
    print(f"  launch count differs {tally['count_mismatch']}, crashes {len(tally['crashes'])}")
    print(
        f"  unknown keys {tally['unknown_keys']}, headlines naming another verl {tally['headlines']}, "
        f"did-you-mean {tally['did_you_mean']} (crossing meaning {tally['did_you_mean_cross']}: {tally['cross'][:5]})"
    )
    if verbose:
        for line in [*tally["false_nogo"], *tally["missed"], *tally["crashes"]]:
            print(f"    {line}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--which", choices=("copy", "project"), default="copy")
    parser.add_argument("-v", "--verbose", action="store_true")
    ns = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    total: dict[str, Any] = collections.defaultdict(int)
    begun = time.perf_counter()
    for path in ns.results:
        start = time.perf_counter()
        tally = measure(json.loads(path.read_text()), ns.which)
        report(path.stem, tally, time.perf_counter() - start, ns.verbose)
        for name, value in tally.items():
            total[name] = total[name] + value if name in total else value
    if len(ns.results) > 1:
        report(f"all {len(ns.results)} files", total, time.perf_counter() - begun, False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

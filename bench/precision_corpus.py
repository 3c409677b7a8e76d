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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAIN = "verl.trainer.main_ppo"
FAILS = ("fails", "compose-error")


def measure(entries: list[dict[str, Any]], which: str, probe: bool = False) -> dict[str, Any]:
    """Audit every script of one results file and compare each main_ppo launch with its oracle verdict; with
    ``probe``, a launch the oracle runs and the audit calls NO-GO for checks verl makes only later (in its workers,
    at the first step) is judged again by that copy's own code on the composed numbers (tests/script_oracle.py)."""
    from audit_vs_oracle import compare_script, oracle_launches
    from script_oracle import PROBES

    from verl_safe_launch.backends import bringup_findings
    from verl_safe_launch.inputs import choose_verl
    from verl_safe_launch.preflight import Auditor

    tally: dict[str, Any] = collections.defaultdict(int)
    tally["false_nogo"], tally["missed"], tally["crashes"], tally["cross"] = [], [], [], []
    tally["confirmed_lines"] = []
    tally["by_rule"], tally["verl"] = collections.Counter(), collections.Counter()
    auditor = Auditor(job_findings=bringup_findings)
    later: list[tuple[dict[str, Any], Any]] = []
    chosen: Path | None = None
    choose_verl(None, "--verl")
    for entry in entries:
        expected = oracle_launches(entry["launches"])
        if expected is None:
            continue
        copy = Path(entry["copy"]) if which == "copy" else None
        if copy != chosen:  # choosing clears every cache of the verl in use: once per copy, not per script
            choose_verl(copy, "--verl")
            chosen = copy
        compared = compare_script(auditor, Path(entry["script"]), expected, entry["path"])
        if compared.crash is not None:
            tally["crashes"].append(compared.crash)
        if compared.verl is not None:
            tally["verl"][compared.verl] += 1
        tally["count_mismatch"] += compared.count_mismatch
        for launch in compared.launches:
            errors = launch.errors
            tally["launches"] += 1
            tally["errors"] += len(errors)
            _suggestions(tally, launch.findings)
            tally["right"] += len(errors) if launch.refused else 0
            if launch.refused:
                tally["refused"] += 1
                tally["refused_nogo"] += launch.verdict == "no-go"
                tally["settled_by_env"] += launch.settled_by_env
                if launch.verdict != "no-go":
                    tally["missed"].append(f"{launch.label} ({launch.verdict}): {launch.reason[:120]}")
            elif launch.verdict == "no-go":
                rules = sorted({f.rule_id for f in errors})
                if probe and set(rules) <= set(PROBES):  # judged again with the copy's own code below
                    later.append((entry, launch))
                    continue
                _false_nogo(tally, launch)
    choose_verl(None)
    for (_entry, launch), verdict in zip(later, _probed(later), strict=True):
        if verdict is None:
            _false_nogo(tally, launch)
        else:
            tally["confirmed"] += 1
            tally["right"] += len(launch.errors)
            tally["confirmed_lines"].append(f"{launch.label}: {verdict[:140]}")
    return tally


def _false_nogo(tally: dict[str, Any], launch: Any) -> None:
    rules = sorted({f.rule_id for f in launch.errors})
    tally["by_rule"].update(rules)
    first = launch.errors[0].message[:140] if launch.errors else ""
    tally["false_nogo"].append(f"{launch.label}: {rules} {first}")


def _probed(later: list[tuple[dict[str, Any], Any]]) -> list[str | None]:
    """For each launch, what the copy's own code says when every one of its errors is run there (None: it does
    not fail everywhere the audit says it does)."""
    from audit_vs_oracle import judged_again, worker_confirmed

    asked = [
        ({k: entry.get(k) for k in ("path", "script", "copy", "root")}, launch) for entry, launch in later
    ]
    return [
        worker_confirmed(now, launch) for (_, launch), now in zip(asked, judged_again(asked), strict=True)
    ]


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
    print(
        f"  false NO-GO {len(tally['false_nogo'])} by rule {dict(tally['by_rule'])}; NO-GO on a launch the oracle "
        f"runs, confirmed by the copy's own worker code: {tally['confirmed']}"
    )
    print(
        f"  refused by verl {tally['refused']}, NO-GO {tally['refused_nogo']} ({tally['settled_by_env']} of them "
        f"UNVERIFIED and NO-GO once audited as the oracle ran them: its unset variables, --trace here), recall {recall:.1%}"
    )
    print(f"  launch count differs {tally['count_mismatch']}, crashes {len(tally['crashes'])}")
    print(
        f"  unknown keys {tally['unknown_keys']}, headlines naming another verl {tally['headlines']}, "
        f"did-you-mean {tally['did_you_mean']} (crossing meaning {tally['did_you_mean_cross']}: {tally['cross'][:5]})"
    )
    if verbose:
        for line in [*tally["false_nogo"], *tally["missed"], *tally["crashes"], *tally["confirmed_lines"]]:
            print(f"    {line}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--which", choices=("copy", "project"), default="copy")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="judge worker-stage NO-GOs again with each copy's own code (slow)",
    )
    ns = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    total: dict[str, Any] = collections.defaultdict(int)
    begun = time.perf_counter()
    for path in ns.results:
        start = time.perf_counter()
        tally = measure(json.loads(path.read_text()), ns.which, ns.probe)
        report(path.stem, tally, time.perf_counter() - start, ns.verbose)
        for name, value in tally.items():
            total[name] = total[name] + value if name in total else value
    if len(ns.results) > 1:
        report(f"all {len(ns.results)} files", total, time.perf_counter() - begun, False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

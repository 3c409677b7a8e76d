"""Precision of ``audit`` on the corpus of launch scripts (tests/data/scripts/corpus/), judged by real bash and verl.

The expected verdict of every launch comes from running the script under bash with the launchers replaced by
recorders (``--trace``), composing what bash passed with Hydra, and asking the installed verl's own
``validate_config``; ``expected.json`` may add, per launch, rules that model a failure verl only hits after Ray
starts (``late``), mark a launch whose failure depends on a value from outside the script (``outside``: UNVERIFIED is
a right answer there), or leave a launch to a check this bench does not measure (``skip``: the reason). Prints error
precision (errors on launches that really fail / all errors), recall (launches verl refuses that are NO-GO / all
launches verl refuses), false NO-GO (launches that run but are declared NO-GO), false GO, unverified launches and
crashes.

    .venv/bin/python bench/precision.py            # audit the corpus and compare with expected.json
    .venv/bin/python bench/precision.py --derive   # recompute expected.json from bash + Hydra + verl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_tiny_model  # noqa: E402
from verl_oracle import verl_verdict  # noqa: E402

from verl_safe_launch.backends import bringup_findings  # noqa: E402
from verl_safe_launch.compose import compose  # noqa: E402
from verl_safe_launch.findings import Severity  # noqa: E402
from verl_safe_launch.inputs import OverrideToken  # noqa: E402
from verl_safe_launch.preflight import Auditor  # noqa: E402
from verl_safe_launch.provenance import Layer, Source  # noqa: E402
from verl_safe_launch.shell import read_script, trace_script, traced_launches  # noqa: E402

CORPUS = ROOT / "tests" / "data" / "scripts" / "corpus"
EXPECTED = CORPUS / "expected.json"
ENV = {"HOME": "/home/vsl", "USER": "vsl"}
MODEL_KEYS = (
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "distillation.teacher_models.teacher_model.model_path",
)


def derive(model: Path) -> dict[str, Any]:
    """Per script and launch: what verl (and Hydra before it) says about the command line bash really ran."""
    old = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {}
    out: dict[str, Any] = {}
    for path in sorted(CORPUS.glob("*.sh")):
        static = read_script(path)
        launches = traced_launches(str(path), trace_script(path, ENV).calls, static)
        entries = []
        for k, launch in enumerate(launches):
            reason = _verl_reason(launch.request(lenient=True), model)
            kept = old.get(path.name, [])[k] if k < len(old.get(path.name, [])) else {}
            entries.append({"late": [], **kept, "verl": reason})
        out[path.name] = entries
        print(f"{path.name}: {[(e['verl'] is None and 'runs') or 'fails' for e in entries]}", flush=True)
    return out


def _verl_reason(request: Any, model: Path) -> str | None:
    source = Source(Layer.CLI)
    extra = tuple(OverrideToken(f"++{key}={model}", source) for key in MODEL_KEYS)
    composed = compose(
        type(request)(overrides=(*request.overrides, *extra), config_files=request.config_files, lenient=True)
    )
    if composed.rejected:
        return f"Hydra: {composed.rejected[0].reason}"
    return verl_verdict(composed.cfg)


def measure(expected: dict[str, Any]) -> dict[str, Any]:
    """Audit every corpus script statically and compare each launch with its expected outcome."""
    auditor = Auditor(job_findings=bringup_findings)
    tally: dict[str, Any] = {
        "scripts": 0,
        "launches": 0,
        "errors": 0,
        "right": 0,
        "false_nogo": [],
        "false_go": [],
        "unverified": [],
        "refused": 0,
        "refused_nogo": 0,
        "missed": [],
        "skipped": [],
        "crashes": [],
        "wrong": [],
    }
    for path in sorted(CORPUS.glob("*.sh")):
        tally["scripts"] += 1
        try:
            result = auditor.script(path)
        except Exception:  # a crash is what this counts
            tally["crashes"].append(f"{path.name}: {traceback.format_exc().splitlines()[-1]}")
            continue
        if result.error is not None:
            tally["crashes"].append(f"{path.name}: {result.error.render()}")
            continue
        for k, item in enumerate(result.launches):
            _judge(tally, f"{path.name}#{k + 1}", item, expected.get(path.name, [])[k : k + 1])
    return tally


def _judge(tally: dict[str, Any], label: str, item: Any, expected: list[dict[str, Any]]) -> None:
    if expected and expected[0].get("skip"):
        tally["skipped"].append(f"{label} ({expected[0]['skip']})")
        return
    tally["launches"] += 1
    fails = bool(expected) and expected[0]["verl"] is not None
    late = set(expected[0].get("late", [])) if expected else set()
    outside = bool(expected) and bool(expected[0].get("outside"))
    errors = [f for f in item.findings if f.severity is Severity.ERROR]
    tally["errors"] += len(errors)
    for finding in errors:
        if fails or finding.rule_id in late:
            tally["right"] += 1
        else:
            tally["wrong"].append(f"{label}: [{finding.rule_id}] {finding.message[:140]}")
    verdict = item.verdict
    if verdict == "unverified":
        tally["unverified"].append(label + (" (outside)" if outside else ""))
    if (fails or late) and not outside:
        tally["refused"] += 1
        tally["refused_nogo"] += verdict == "no-go"
        if verdict != "no-go":
            tally["missed"].append(f"{label} ({verdict})")
    if verdict == "no-go" and not fails and not late:
        tally["false_nogo"].append(label)
    if verdict == "go" and (fails or late):
        tally["false_go"].append(label)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--derive", action="store_true", help="recompute expected.json from bash + Hydra + verl"
    )
    ns = parser.parse_args()
    if ns.derive:
        with tempfile.TemporaryDirectory() as tmp:
            expected = derive(make_tiny_model(Path(tmp) / "tiny-model"))
        EXPECTED.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        print(f"wrote {EXPECTED}")
        return 0
    start = time.perf_counter()
    tally = measure(json.loads(EXPECTED.read_text()))
    precision = tally["right"] / tally["errors"] if tally["errors"] else 1.0
    print(
        f"corpus: {tally['scripts']} scripts, {tally['launches']} launches ({time.perf_counter() - start:.0f} s)"
    )
    recall = tally["refused_nogo"] / tally["refused"] if tally["refused"] else 1.0
    print(f"error findings: {tally['errors']}, right: {tally['right']}, error precision: {precision:.1%}")
    print(
        f"launches verl refuses: {tally['refused']}, NO-GO: {tally['refused_nogo']}, recall: {recall:.1%}"
        f"; missed {tally['missed']}"
    )
    print(f"false NO-GO: {len(tally['false_nogo'])} {tally['false_nogo']}")
    print(f"false GO: {len(tally['false_go'])} {tally['false_go']}")
    print(f"unverified launches: {len(tally['unverified'])} {tally['unverified']}")
    print(f"left to other checks: {len(tally['skipped'])} {tally['skipped']}")
    print(f"crashes: {len(tally['crashes'])} {tally['crashes']}")
    for line in tally["wrong"]:
        print(f"  wrong: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Real projects on older verl (tests/data/upgrade_projects/): each script upgraded in its checkout, every advice
line judged by verl (validate_config, its registries) and by the engine it is handed to; every value the old run
had and the new run changes, and every override of the script, looked for in the report; and each script upgraded
alone, without its project's verl, to measure release detection.

    .venv/bin/python bench/upgrade_projects.py                 # upgrade and judge, in this process
    .venv/bin/python bench/upgrade_projects.py --only Search-R1

The shares behind detection's era settings (``ERAS`` in verl_safe_launch/audit/detect.py), counted again over the
example scripts of verl's tags (a folder per tag holding its examples/ and recipe/ scripts):

    .venv/bin/python bench/upgrade_projects.py --eras TAGS_DIR

To measure another version of the tool with the same judges, let it upgrade and this one judge:

    PYTHONPATH=OLD_TREE .venv/bin/python bench/upgrade_projects.py --upgrades-only runs.json --keep DIR
    .venv/bin/python bench/upgrade_projects.py --judge runs.json

Prints one row per script, then the totals: advice lines rejected / no-op / right, behaviour changes not listed,
overrides in no line, detection within one minor release (asked for --from), seconds per script.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_tiny_model  # noqa: E402
from upgrade_projects import (  # noqa: E402
    CorpusScript,
    Judged,
    corpus_scripts,
    judge_result,
    lone_detection,
    upgrade,
    within_one,
)


def _upgrades(scripts: list[CorpusScript], keep: Path, same_lone: bool) -> list[dict[str, object]]:
    """Upgrade every script in its checkout and alone; the JSON documents and written YAML stay in ``keep``."""
    runs: list[dict[str, object]] = []
    upgrade(scripts[0].path, keep / "warm-up")  # imports (verl, torch) are not any one script's time
    for i, script in enumerate(scripts):
        cpu = time.process_time()
        code, data, err, seconds = upgrade(script.path, keep / f"{i:03d}")
        cpu = time.process_time() - cpu
        start = time.perf_counter()
        if same_lone:
            asked = code == 2 and "--from" in err
            release = data["source_release"] if data else None
        else:
            asked, release = lone_detection(script, keep / f"{i:03d}-lone")
        lone_seconds = time.perf_counter() - start
        runs.append(
            {
                "name": script.name,
                "code": code,
                "data": data,
                "err": err,
                "seconds": seconds,
                "cpu": cpu,
                "lone": {"asked": asked, "release": release, "seconds": lone_seconds},
            }
        )
        print(f"upgraded {script.name}: exit {code}, {seconds:.2f} s", file=sys.stderr, flush=True)
    return runs


def _row(judged: Judged, lone: dict[str, object]) -> str:
    truth = judged.script.truth
    release = lone["release"]
    detection = (
        "asked" if lone["asked"] else f"{release}{'' if within_one(str(release), truth) else ' WRONG'}"
    )
    return (
        f"{judged.script.name:70} exit={judged.exit_code} {judged.seconds:5.2f}s advice={len(judged.advice)} "
        f"rejected={len(judged.rejected)} noop={len(judged.noop)} unlisted={len(judged.unlisted)} "
        f"unreported={len(judged.unreported)} lone={detection} (truth {truth})"
    )


def _eras(tags: Path) -> None:
    """Per tag: how many of its example scripts export each era setting."""
    from verl_safe_launch.audit.detect import ERAS

    def order(tag: Path) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", tag.name))

    for era in ERAS:
        setting = re.compile(rf"\b{era.name}=[\"']?{era.value}\b")
        print(f"{era.name}={era.value} (read as verl {era.last} or older):")
        for tag in sorted((t for t in tags.iterdir() if t.is_dir()), key=order):
            scripts = sorted(tag.rglob("*.sh"))
            found = sum(bool(setting.search(s.read_text(errors="replace"))) for s in scripts)
            share = f"{100 * found / len(scripts):4.1f}%" if scripts else "  -"
            print(f"  {tag.name:24} {found:3} of {len(scripts):3} scripts  {share}")


def main() -> int:
    """Upgrade, judge, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="scripts whose name contains this")
    parser.add_argument(
        "--upgrades-only", metavar="OUT.json", help="upgrade and write the runs, do not judge"
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="where the upgraded YAML files stay (with --upgrades-only)"
    )
    parser.add_argument("--judge", metavar="IN.json", help="judge runs written by --upgrades-only")
    parser.add_argument("--verbose", action="store_true", help="print every finding of the judges")
    parser.add_argument(
        "--same-lone",
        action="store_true",
        help="take the in-place run as the lone one (for a tool that does not read the project's verl)",
    )
    parser.add_argument(
        "--eras", metavar="TAGS_DIR", help="count the era settings in each tag's example scripts"
    )
    ns = parser.parse_args()
    if ns.eras:
        _eras(Path(ns.eras))
        return 0
    scripts = [s for s in corpus_scripts() if not ns.only or ns.only in s.name]
    with tempfile.TemporaryDirectory(prefix="vsl-bench-") as tmp:
        if ns.judge:
            runs = json.loads(Path(ns.judge).read_text())
        else:
            keep = Path(ns.keep) if ns.keep else Path(tmp)
            runs = _upgrades(scripts, keep, ns.same_lone)
            if ns.upgrades_only:
                Path(ns.upgrades_only).write_text(json.dumps(runs))
                return 0
        by_name = {s.name: s for s in corpus_scripts()}
        model = make_tiny_model(Path(tmp) / "model", num_attention_heads=32, num_key_value_heads=8)
        judged = []
        for run in runs:
            script = by_name[str(run["name"])]
            data = run["data"] if isinstance(run["data"], dict) else None
            result = judge_result(
                script, int(run["code"]), data, str(run["err"]), float(run["seconds"]), model
            )
            judged.append((result, {**run["lone"], "cpu": run.get("cpu", float("nan"))}))
            print(_row(result, run["lone"]), flush=True)
            if ns.verbose:
                for line in (*result.rejected, *result.noop, *result.unlisted, *result.unreported):
                    print(f"    {line}")
                if result.error:
                    print(f"    error: {result.error}")
    _totals(judged)
    return 0


def _totals(judged: list[tuple[Judged, dict[str, object]]]) -> None:
    results = [j for j, _ in judged]
    advice = sum(len(j.advice) for j in results)
    rejected = sum(len(j.rejected) for j in results)
    noop = sum(len(j.noop) for j in results)
    print(f"scripts: {len(results)}; upgraded: {sum(j.exit_code == 0 for j in results)}")
    print(
        f"advice lines: {advice}; rejected by verl or its engine: {rejected}; no-op: {noop}; right: {advice - rejected - noop}"
    )
    print(f"behaviour changes not listed: {sum(len(j.unlisted) for j in results)}")
    print(f"overrides in no line: {sum(len(j.unreported) for j in results)}")
    asked = [lone for _, lone in judged if lone["asked"]]
    right = sum(
        1 for j, lone in judged if not lone["asked"] and within_one(str(lone["release"]), j.script.truth)
    )
    print(
        f"lone scripts (no vendored verl): {right} of {len(judged)} detected within one minor release, "
        f"{len(asked)} asked for --from, {len(judged) - right - len(asked)} detected wrong"
    )
    seconds = [j.seconds for j in results]
    print(f"seconds per script (in place): mean {statistics.mean(seconds):.2f}, max {max(seconds):.2f}")
    cpu = [float(str(lone.get("cpu", "nan"))) for _, lone in judged]
    print(f"CPU seconds per script (in place): mean {statistics.mean(cpu):.2f}, max {max(cpu):.2f}")


if __name__ == "__main__":
    raise SystemExit(main())

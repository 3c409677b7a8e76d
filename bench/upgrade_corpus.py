"""The upgrade corpus (tests/data/upgrade_corpus/): each script upgraded and judged by Hydra's compose, `check` and
verl's own validate_config.

Prints per script: the release range that fits, whether it was asked for --from, drops, refusals, project keys,
advice lines and advice verl rejects; then the totals: release detection accuracy, behaviour drops, advice failures,
silent Ulysses SP changes, values not accounted for.

    .venv/bin/python bench/upgrade_corpus.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from upgrade_corpus import Outcome, corpus, judge  # noqa: E402


def _row(outcome: Outcome) -> str:
    kinds = [c["kind"] for c in outcome.changes]
    fits = "asked --from" if outcome.weak_asked else f"{outcome.fits[0]}..{outcome.fits[1]}"
    return (
        f"{outcome.name:34} want {outcome.expected} fits {fits:12} right={outcome.detected_right!s:5} "
        f"removed={len(outcome.drops)} refused={kinds.count('refused')} project={kinds.count('project')} "
        f"advice={outcome.advice} advice-fail={len(outcome.advice_failures)} check-errors={len(outcome.check_errors)} "
        f"unaccounted={len(outcome.unaccounted)} sp-changed={len(outcome.sp_changes)} {outcome.seconds:.2f}s"
    )


def main() -> int:
    """Judge every script and print the figures."""
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp:
        judge(corpus()[0], Path(tmp) / "warm-up")  # imports (verl, torch) are not any one script's time
        for script in corpus():
            outcome = judge(script, Path(tmp) / script.stem)
            outcomes.append(outcome)
            print(_row(outcome), flush=True)
            for line in [
                *outcome.check_errors,
                *outcome.unaccounted,
                *outcome.advice_failures,
                *outcome.sp_changes,
            ]:
                print(f"    {line}")
    detected = [o for o in outcomes if not o.weak_asked]
    print(f"scripts: {len(outcomes)}; asked for --from (weak evidence): {len(outcomes) - len(detected)}")
    right = sum(o.detected_right for o in detected)
    print(f"release detection: {right} of {len(detected)} detected within one minor release of the truth")
    print(f"drops, each with its reason: {sum(len(o.drops) for o in outcomes)}")
    print(f"values not accounted for: {sum(len(o.unaccounted) for o in outcomes)}")
    print(f"silent Ulysses SP changes: {sum(len(o.sp_changes) for o in outcomes)}")
    print(f"check errors outside refused parts: {sum(len(o.check_errors) for o in outcomes)}")
    advice = sum(o.advice for o in outcomes)
    print(
        f"advice lines: {advice}; rejected by verl's validate_config: {sum(len(o.advice_failures) for o in outcomes)}"
    )
    seconds = [o.seconds for o in outcomes]
    print(f"seconds per upgrade: mean {sum(seconds) / len(seconds):.2f}, max {max(seconds):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

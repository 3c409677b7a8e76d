"""Every example launch script of four verl releases, audited under that release, against what the release itself does;
and the same for three copies of verl that are not on PyPI: the verl 0.1 Search-R1 vendors, the verl 0.3 fork
verl-agent vendors, and a snapshot of verl's main branch (0.10.0.dev).

The data: tests/data/release_examples/<case>/ holds the case's scripts that run ``verl.trainer.main_ppo`` (byte for
byte, at their repository paths, SOURCES.json says from where) and ``expected.json``: per script and launch, what real
bash ran, that verl's Hydra composed and that verl's own validation said (``runs``, ``fails``, ``compose-error``,
``not-ppo``, ``env-blocked``) and why. A release tag (``v0.5.0``) is judged under that release from pip; a project
(``project-Search-R1``) is its repository tree with the vendored copy at its path ``verl/`` beside the scripts, and the
audit finds that copy by itself, as it does in the project's checkout; a snapshot (``main-0.10.0.dev``) is judged
under the copy shipped in tests/data/verl_copies/<case>/. Remake it with

    .venv/bin/python tests/script_oracle.py --derive tests/data/release_examples --releases DIR [--only CASE ...]

(DIR holds ``<version>/verl`` per release: the ``releases`` fixture's directory.) The verdicts are read from there;
every launch the audit calls NO-GO is judged again live by the release (tests/script_oracle.py, one subprocess per
release), so no NO-GO rests on a stored verdict alone.

A launch the release's validation accepts may still fail in its workers or at the first training step (a micro batch
that does not divide the per-GPU mini batch, a Ulysses mesh larger than the GPUs): NO-GO there is right only when
that release's own code, run on the composed numbers (tests/script_oracle.py ``PROBES``), fails too. No GPU here:
the probes call the release's functions on CPU (a fake process group for device meshes).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
from audit_vs_oracle import FAILS, Compared, compare_script, judged_again, oracle_launches, worker_confirmed

from verl_safe_launch.backends import bringup_findings
from verl_safe_launch.inputs import choose_verl, project_verl
from verl_safe_launch.preflight import Auditor

pytestmark = pytest.mark.slow  # each release's Hydra and validation run in a subprocess

EXAMPLES = Path(__file__).parent / "data" / "release_examples"
TAGS = ("v0.5.0", "v0.6.1", "v0.7.1", "v0.8.0")
COPIES = ("project-Search-R1", "project-verl-agent", "main-0.10.0.dev")
"""Copies not on PyPI: two projects' vendored verl (found by the audit itself) and a main snapshot."""


def _copy(tag: str, request: pytest.FixtureRequest) -> tuple[Path, bool]:
    """The directory holding the case's ``verl/``, and whether the audit is to find it by itself (a project)."""
    if (EXAMPLES / tag / "verl").is_dir():
        return EXAMPLES / tag, True
    if tag in COPIES:
        return Path(__file__).parent / "data" / "verl_copies" / tag, False
    releases: Path = request.getfixturevalue("releases")
    return releases / tag.removeprefix("v"), False


def _audit(
    tag: str, copy: Path, found_by_audit: bool
) -> tuple[list[tuple[str, Compared]], collections.Counter[str], list[str]]:
    data = json.loads((EXAMPLES / tag / "expected.json").read_text())
    auditor = Auditor(job_findings=bringup_findings)
    compared: list[tuple[str, Compared]] = []
    counts: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    choose_verl(None if found_by_audit else copy, "--verl")
    try:
        for path, entry in data["scripts"].items():
            expected = oracle_launches(entry["launches"])
            if expected is None:
                counts["not compared (no main_ppo launch, or env-blocked)"] += 1
                continue
            script = EXAMPLES / tag / path
            if found_by_audit:  # the project's own copy, found beside or above the script as audit finds it
                package = project_verl(script).path
                if package.resolve() != (copy / "verl").resolve():
                    problems.append(f"{path}: the audit reads the verl at {package}, not the project's copy")
            result = compare_script(auditor, script, expected, path)
            if found_by_audit and result.verl is not None and str(copy / "verl") not in result.verl:
                problems.append(f"{path}: the audit's header names another verl: {result.verl}")
            if result.crash is not None:
                problems.append(f"crash: {result.crash}")
            if result.count_mismatch:
                problems.append(f"{path}: the audit reads another number of launches than bash ran")
            compared += [(path, launch) for launch in result.launches]
    finally:
        choose_verl(None)
    return compared, counts, problems


def _live(tag: str, copy: Path, nogo: list[tuple[str, Compared]]) -> dict[str, dict[str, Any]]:
    """The release's verdict, judged again now, on every launch called NO-GO; worker-stage probes where the
    launch's every error is a worker-stage rule."""
    where = {"copy": str(copy), "root": str(EXAMPLES / tag)}
    asked = [({**where, "path": path, "script": str(EXAMPLES / tag / path)}, launch) for path, launch in nogo]
    return {launch.label: now for (_, launch), now in zip(asked, judged_again(asked), strict=True)}


@pytest.mark.parametrize("tag", TAGS + COPIES)
def test_release_examples_audit_as_the_release_judges_them(tag: str, request: pytest.FixtureRequest) -> None:
    copy, found_by_audit = _copy(tag, request)
    compared, counts, problems = _audit(tag, copy, found_by_audit)
    nogo = [(path, launch) for path, launch in compared if launch.verdict == "no-go"]
    live = _live(tag, copy, nogo)
    false_nogo, misses, confirmed = [], [], []
    for _, launch in compared:
        if launch.refused and launch.verdict != "no-go":
            misses.append(f"{launch.label} ({launch.verdict}): {launch.reason[:160]}")
        if launch.verdict != "no-go":
            continue
        now = live[launch.label]
        if launch.refused:
            if now["summary"] not in FAILS:  # the stored verdict no longer holds: expected.json is stale
                problems.append(
                    f"{launch.label}: expected.json says refused, the release now says {now['summary']}"
                )
            continue
        rules = sorted({f.rule_id for f in launch.errors})
        failure = worker_confirmed(now, launch)
        if failure is not None:
            confirmed.append(f"{launch.label}: {rules} {failure[:160]}")
        else:
            first = launch.errors[0].message[:160] if launch.errors else ""
            false_nogo.append(
                f"{launch.label}: {rules} {first} (release's probes: {now.get('probes') or {}})"
            )
    errors = sum(len(launch.errors) for _, launch in compared)
    right = sum(len(launch.errors) for _, launch in compared if launch.refused)
    refused = [launch for _, launch in compared if launch.refused]
    print(
        f"\n{tag}: {len(compared)} launches, error findings {errors}, right {right}, "
        f"false NO-GO {len(false_nogo)}, refused {len(refused)}, "
        f"NO-GO {sum(launch.verdict == 'no-go' for launch in refused)} "
        f"({sum(launch.settled_by_env for launch in refused)} once audited as the oracle ran them), "
        f"misses {len(misses)}, worker-confirmed {len(confirmed)}, {dict(counts)}"
    )
    for line in confirmed:
        print(f"  worker-confirmed {line}")
    assert compared, "no launch compared"
    assert problems == []
    assert misses == []
    assert false_nogo == []

"""The corpus of launch scripts: audit's verdicts against what bash passes and what verl's validate_config says.

``expected.json`` is derived by ``bench/precision.py --derive`` (bash with recorders, Hydra, verl's own
``validate_config``); ``late`` lists the rules that model a failure verl only hits after Ray starts, ``outside``
marks a failure decided by a value from outside the script, ``skip`` a launch judged by a check measured elsewhere.
"""

from __future__ import annotations

import json

import pytest
from conftest import DATA

from verl_safe_launch.backends import bringup_findings
from verl_safe_launch.findings import Severity
from verl_safe_launch.preflight import Auditor

CORPUS = DATA / "scripts" / "corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
SCRIPTS = sorted(CORPUS.glob("*.sh"))
AUDITOR = Auditor(job_findings=bringup_findings)


def test_corpus_is_large_and_fully_derived() -> None:
    assert len(SCRIPTS) >= 40
    assert sorted(EXPECTED) == [p.name for p in SCRIPTS]


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_verdicts_match_bash_and_verl(path: object) -> None:
    result = AUDITOR.script(path)  # type: ignore[arg-type]
    assert result.error is None, result.error
    expected = EXPECTED[result.path.rsplit("/", 1)[-1]]
    assert len(result.launches) == len(expected)
    for item, want in zip(result.launches, expected, strict=True):
        if want.get("skip"):
            continue
        errors = {f.rule_id for f in item.findings if f.severity is Severity.ERROR}
        if want["verl"] is None:
            assert errors <= set(want["late"]), (errors, want)  # no error on a launch that runs
        if want.get("outside"):
            assert item.verdict != "go", want  # decided by a value from outside: UNVERIFIED at best
        elif want["verl"] is not None or want["late"]:
            assert item.verdict == "no-go", want  # every launch verl refuses is NO-GO
        else:
            assert item.verdict in ("go", "unverified")

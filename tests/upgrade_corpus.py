"""The upgrade corpus (tests/data/upgrade_corpus/): launch scripts in the style of verl 0.1-0.5, each upgraded and
judged by independent oracles: Hydra's compose, `check`, and verl's own validate_config for every advice line.

Shared by tests/test_upgrade_corpus.py and bench/upgrade_corpus.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_oracle import verl_verdict

from verl_safe_launch.audit import depends_on
from verl_safe_launch.cli import main
from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.shell import read_script

CORPUS = Path(__file__).parent / "data" / "upgrade_corpus"
SERIES = ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9")
ACCOUNTED = ("moved", "converted", "removed", "refused", "project", "added")


@dataclass
class Outcome:
    """What one script's upgrade did, as the oracles judge it."""

    name: str
    expected: str
    fits: tuple[str, str] = ("", "")
    weak_asked: bool = False
    exit_code: int = 0
    rejected: list[str] = field(default_factory=list)
    check_errors: list[str] = field(default_factory=list)
    unaccounted: list[str] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    advice: int = 0
    advice_failures: list[str] = field(default_factory=list)
    sp_changes: list[str] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    """Wall-clock time of the upgrade itself (the last run, when it was asked for --from first)."""

    @property
    def detected_right(self) -> bool:
        """The expected release lies in the fitting range and the release upgraded from is within one minor."""
        if self.weak_asked:
            return False
        lo, hi = (SERIES.index(s) for s in self.fits)
        want = SERIES.index(self.expected)
        return lo <= want <= hi and want - lo <= 1


def header(path: Path, name: str) -> str | None:
    """The value of a ``# name: value`` header line of a corpus script."""
    found = re.search(rf"^# {name}: (.*)$", path.read_text(), re.MULTILINE)
    return found.group(1).strip() if found else None


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """verl reads a critic's model config in validate_config: never from the network here."""
    from huggingface_hub import constants

    before, env = constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def upgrade(path: Path, out_dir: Path) -> tuple[Outcome, dict[str, Any] | None]:
    """Run ``upgrade`` on one script (asked for --from when its evidence is weak, then given it)."""
    outcome = Outcome(path.name, header(path, "expect-release") or "?")
    args = shlex.split(header(path, "args") or "")
    base = ["upgrade", str(path), *args, "--format", "json", "-o", str(out_dir), "--force"]
    start = time.perf_counter()
    code, out, err = _run(base)
    if code == 2 and "--from" in err:
        outcome.weak_asked = True
        start = time.perf_counter()
        code, out, err = _run([*base, "--from", outcome.expected])
    outcome.seconds = time.perf_counter() - start
    outcome.exit_code = code
    if code != 0:
        return outcome, None
    data: dict[str, Any] = json.loads(out)
    outcome.fits = (data["fits"][0], data["fits"][1])
    outcome.changes = data["changes"]
    return outcome, data


def upgraded_config(data: dict[str, Any], extra: list[str] | None = None) -> Composed:
    """The upgraded launch as the printed command runs it, plus ``extra`` overrides."""
    words = shlex.split(data["command"])[1:]
    files = tuple(Path(words[i + 1]) for i, w in enumerate(words) if w == "-c")
    tokens = [w for i, w in enumerate(words) if w != "-c" and (i == 0 or words[i - 1] != "-c")]
    return compose(
        ComposeRequest(config_files=files, overrides=cli_tokens([*tokens, *(extra or [])]), lenient=True)
    )


def _effective_sp(values: dict[str, int | None]) -> dict[str, int]:
    """Ulysses SP per role as the release the values were written for runs them."""
    actor = values.get("actor") or 1
    ref = values.get("ref") or actor
    return {"actor": actor, "ref": ref, "critic": values.get("critic") or 1}


def _sp_before(path: Path) -> dict[str, int]:
    launch = read_script(path)[0]
    found: dict[str, int | None] = {}
    for token in launch.tokens:
        key, _, value = token.text.lstrip("+").partition("=")
        for role, prefix in (
            ("actor", "actor_rollout_ref.actor."),
            ("ref", "actor_rollout_ref.ref."),
            ("critic", "critic."),
        ):
            if key.startswith(prefix) and key.endswith("ulysses_sequence_parallel_size"):
                found[role] = int(value)
    return _effective_sp(found)


def _sp_after(composed: Composed) -> dict[str, int]:
    view = composed.view

    def role(old: str, new: str) -> int:
        deprecated, current = view.get(old), view.get(new)
        return int(deprecated) if isinstance(deprecated, int) and deprecated > 1 else int(current or 1)

    arr = "actor_rollout_ref"
    return {
        "actor": role(
            f"{arr}.actor.ulysses_sequence_parallel_size",
            f"{arr}.actor.fsdp_config.ulysses_sequence_parallel_size",
        ),
        "ref": role(
            f"{arr}.ref.ulysses_sequence_parallel_size",
            f"{arr}.ref.fsdp_config.ulysses_sequence_parallel_size",
        ),
        "critic": int(view.get("critic.fsdp.ulysses_sequence_parallel_size") or 1),
    }


def judge(path: Path, out_dir: Path) -> Outcome:
    """Upgrade one script and judge the result."""
    outcome, data = upgrade(path, out_dir)
    if data is None:
        return outcome
    composed = upgraded_config(data)
    outcome.rejected = [r.token.text for r in composed.rejected]
    changes = data["changes"]
    refused = {c["key"] for c in changes if c["kind"] in ("refused", "project")}
    refused |= {c["new_key"] for c in changes if c["kind"] == "refused" and c["new_key"]}
    for finding in run_preflight(composed).findings:
        if finding.severity is Severity.ERROR and not set(depends_on(finding)) & refused:
            outcome.check_errors.append(f"[{finding.rule_id}] {finding.message[:160]}")
    explained = {c["key"] for c in changes if c["kind"] in ACCOUNTED}
    launch = read_script(path)[0]
    for token in launch.tokens:
        key = token.text.lstrip("+~").partition("=")[0]
        if key not in explained and composed.view.get(key) is None and not token.text.endswith("=null"):
            outcome.unaccounted.append(token.text)
    outcome.drops = [c["detail"] for c in changes if c["kind"] == "removed"]
    before, after = _sp_before(path), _sp_after(composed)
    outcome.sp_changes = [f"{r}: {before[r]} -> {after[r]}" for r in before if before[r] != after[r]]
    _judge_advice(outcome, data)
    return outcome


def _judge_advice(outcome: Outcome, data: dict[str, Any]) -> None:
    """verl's own validate_config on the upgraded launch with the advice applied, against it without."""
    fixes = [c["fix"] for c in data["changes"] if c["fix"]]
    outcome.advice = len(fixes)
    if not fixes:
        return
    with offline():
        base = verl_verdict(upgraded_config(data).cfg)
        together = upgraded_config(data, fixes)
        if not together.rejected and verl_verdict(together.cfg) == base:
            return
        for fix in fixes:
            alone = upgraded_config(data, [fix])
            verdict = "composition refused" if alone.rejected else verl_verdict(alone.cfg)
            if verdict != base:
                outcome.advice_failures.append(f"{fix}: {verdict}")


def corpus() -> list[Path]:
    """The corpus scripts, sorted."""
    return sorted(CORPUS.glob("*.sh"))

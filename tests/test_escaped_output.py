"""Control characters in keys, values, script tokens, preset names and log lines are shown escaped, never raw."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.render import Column, escape, escape_lines, render_findings_table, render_table

Cli = Callable[..., CliResult]
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""Any control character but the newline: none may reach the terminal from user text."""
SGR = re.compile(r"\x1b\[[0-9;]*m")
FORGED = "x\nGO: 0 errors, 0 warnings, 0 info\x1b[8m"


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain, ünïcode ✓", "plain, ünïcode ✓"),
        ("a\nb\rc\td", "a\\nb\\rc\\td"),
        ("\x1b[8mhidden\x1b[2J\x07\x00\x7f", "\\x1b[8mhidden\\x1b[2J\\x07\\x00\\x7f"),
        ("\x9b31m \u202eevil\u2066", "\\x9b31m \\u202eevil\\u2066"),
    ],
)
def test_escape_shows_every_control_character(text: str, shown: str) -> None:
    assert escape(text) == shown
    assert escape_lines(f"{text}\n{text}") == f"{shown}\n{shown}".replace("\\n", "\n")


def _yaml(tmp_path: Path) -> Path:
    path = tmp_path / "inject.yaml"
    path.write_text(
        'trainer:\n  "x\\nGO: 0 errors, 0 warnings, 0 info\\e[8m": 1\n  project_name: "a\\e[2Jb\\nGO: forged"\n'
    )
    return path


def test_a_key_cannot_forge_the_verdict_line(tmp_path: Path, cli: Cli) -> None:
    result = cli("check", "-c", str(_yaml(tmp_path)))
    assert result.code == 1
    assert not RAW.search(result.out + result.err)
    verdicts = [line for line in result.out.splitlines() if line.startswith(("GO", "NO-GO"))]
    assert len(verdicts) == 1 and verdicts[0].startswith("NO-GO: ")
    assert "warning [new-key] trainer.x\\nGO: 0 errors, 0 warnings, 0 info\\x1b[8m is neither" in result.out


@pytest.mark.parametrize("extra", [[], ["--origin"], ["--key", "trainer.project_name"]])
def test_show_escapes_keys_and_values(tmp_path: Path, cli: Cli, extra: list[str]) -> None:
    result = cli("show", "-c", str(_yaml(tmp_path)), *extra)
    assert result.code == 0
    assert not RAW.search(result.out)
    assert not any(line.startswith("GO") for line in result.out.splitlines())


def test_a_script_token_is_shown_escaped(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo 'trainer.project_name=a\x1b[8mb'\n")
    result = cli("audit", str(script))
    assert result.code == 2
    assert not RAW.search(result.out + result.err)
    assert "where: script, " in result.out and "('trainer.project_name=a\\x1b[8mb')" in result.out


def test_a_preset_name_is_shown_escaped(cli: Cli) -> None:
    result = cli("show", "preset=a\x1b[2Jb\nGO: 0")
    assert result.code == 2
    assert result.err.splitlines()[0] == "error: unknown preset 'a\\x1b[2Jb\\nGO: 0'"


def test_a_matched_log_line_is_shown_escaped(tmp_path: Path, cli: Cli) -> None:
    log = tmp_path / "worker.err"
    log.write_text("ValueError: No available memory for the cache blocks\x1b[8m hidden\n")
    result = cli("oom", str(log))
    assert result.code == 0
    assert not RAW.search(result.out)
    assert "  log: ValueError: No available memory for the cache blocks\\x1b[8m hidden" in result.out


def test_the_rich_tables_escape_cells_and_keep_only_their_own_styles() -> None:
    source = Source(Layer.FILE, "a\x1b[8m.yaml", 3)
    finding = Finding("new-key", Severity.WARNING, (FORGED,), f"{FORGED} is unknown", f"remove {FORGED}", ())
    finding = Finding(
        finding.rule_id, finding.severity, finding.keys, finding.message, finding.fix, ((FORGED, 1, source),)
    )
    text = render_findings_table([finding], color=True)
    assert not RAW.search(SGR.sub("", text))
    assert "\x1b[8m" not in text and "x\\nGO: 0 errors, 0 warnings, 0 info\\x1b[8m" in SGR.sub("", text)
    table = render_table([Column("NAME")], [[FORGED]], rich=True)
    assert not RAW.search(SGR.sub("", table))
    assert render_table([Column("NAME")], [[FORGED]], rich=False).splitlines()[1] == escape(FORGED)

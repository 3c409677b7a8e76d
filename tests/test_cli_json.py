"""Every verb's ``--format json``: one strict JSON object with ``schema``, and ``verdict``/``summary`` where it judges."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA, EXAMPLES, CliResult

from verl_safe_launch.render import JSON_SCHEMA_VERSION, json_text, strict_json

EXAMPLE = str(EXAMPLES / "grpo_6gpu.yaml")
BAD_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"


def refuse_constant(name: str) -> Any:
    raise AssertionError(f"not strict JSON: {name}")


def strict_loads(text: str) -> dict[str, Any]:
    """Parse as strict JSON (NaN, Infinity and -Infinity are refused) and require one object with ``schema``."""
    data = json.loads(text, parse_constant=refuse_constant)
    assert isinstance(data, dict)
    assert data["schema"] == JSON_SCHEMA_VERSION
    return data


def has_verdict(data: dict[str, Any]) -> None:
    assert data["verdict"] in ("go", "no-go")
    assert set(data["summary"]) == {"errors", "warnings", "info"}
    assert list(data)[:3] == ["schema", "verdict", "summary"]
    assert (data["verdict"] == "no-go") == (data["summary"]["errors"] > 0)


# verb arguments -> whether the verb gives a verdict
VERBS: list[tuple[tuple[str, ...], bool]] = [
    (("check", "-c", EXAMPLE), True),
    (("check", "-c", EXAMPLE, BAD_MICRO), True),
    (("audit", str(DATA / "scripts" / "grpo_gsm8k.sh")), True),
    (("show", "-c", EXAMPLE), False),
    (("show", "--origin", "--key", "data", "-c", EXAMPLE), False),
    (("explain", "-c", EXAMPLE), False),
    (("estimate", "--fit", "-c", EXAMPLE, "hardware.gpu_memory_gb=80"), False),
    (("presets",), False),
    (("presets", "medium"), False),
    (("presets", "auto"), False),
    (("slurm", "preflight", "-c", EXAMPLE, BAD_MICRO), True),
]


@pytest.mark.parametrize(("argv", "verdict"), VERBS, ids=[" ".join(a[:2]) for a, _ in VERBS])
def test_every_verb_prints_one_strict_object(
    argv: tuple[str, ...], verdict: bool, cli: Callable[..., CliResult]
) -> None:
    result = cli(*argv, "--format", "json")
    assert result.code in (0, 1), result.err
    data = strict_loads(result.out)
    if verdict:
        has_verdict(data)
        assert result.code == (1 if data["verdict"] == "no-go" else 0)
    else:
        assert "verdict" not in data


def test_slurm_json(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    script = tmp_path / "job.sbatch"
    argv = ("slurm", "--nodes", "1", "--gpus-per-node", "6", "-c", EXAMPLE, "-o", str(script))
    data = strict_loads(cli(*argv, "--format", "json").out)
    has_verdict(data)
    assert (data["verdict"], data["status"], data["script"]) == ("go", "written", str(script))
    refused = cli(*argv[:-2], BAD_MICRO, "-o", str(tmp_path / "no.sbatch"), "--format", "json")
    data = strict_loads(refused.out)
    has_verdict(data)
    assert (refused.code, data["verdict"], data["status"]) == (1, "no-go", "preflight-failed")


def test_run_json_and_run_directory_share_the_shape(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    run_dir = tmp_path / "run"
    argv = ("run", "--dry-run", "--force", "-c", EXAMPLE, BAD_MICRO, "--run-dir", str(run_dir))
    result = cli(*argv, "--format", "json")
    assert result.code == 0, result.err
    printed = strict_loads(result.out)
    has_verdict(printed)
    assert (printed["status"], printed["exit_code"], printed["verdict"]) == ("dry-run", 0, "no-go")
    recorded = strict_loads((run_dir / "preflight.json").read_text())
    has_verdict(recorded)
    assert recorded["forced"] == ["pre-flight errors"]
    assert (recorded["summary"], recorded["findings"]) == (printed["summary"], printed["findings"])
    assert strict_loads((run_dir / "provenance.json").read_text())["keys"]


def test_run_stopped_by_the_preflight(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    result = cli("run", "-c", EXAMPLE, BAD_MICRO, "--run-dir", str(tmp_path / "r"), "--format", "json")
    data = strict_loads(result.out)
    has_verdict(data)
    assert (result.code, data["status"], data["verdict"]) == (1, "preflight-failed", "no-go")


def test_run_error_before_the_preflight_has_schema_but_no_verdict(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    result = cli("run", "-c", str(tmp_path / "missing.yaml"), "--format", "json")
    assert result.code == 2
    data = strict_loads(result.out)
    assert data["status"] == "error" and "missing.yaml" in data["error"]
    assert "verdict" not in data


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_config_values_print_as_null(value: str, cli: Callable[..., CliResult]) -> None:
    key = "actor_rollout_ref.actor.clip_ratio"
    shown = strict_loads(cli("show", "--key", key, f"{key}={value}", "--format", "json").out)
    assert shown["config"] is None
    origin = strict_loads(cli("show", "--origin", "--key", key, f"{key}={value}", "--format", "json").out)
    assert origin["keys"][0]["value"] is None


def test_strict_json_replaces_only_non_finite_numbers() -> None:
    data = {"a": [1.5, math.nan, (math.inf, -math.inf)], "b": {"c": 0, "d": "nan"}, "e": Path("x")}
    assert strict_json(data) == {"a": [1.5, None, [None, None]], "b": {"c": 0, "d": "nan"}, "e": Path("x")}
    assert json.loads(json_text(data), parse_constant=refuse_constant) == {
        "a": [1.5, None, [None, None]],
        "b": {"c": 0, "d": "nan"},
        "e": "x",
    }


def test_an_unreadable_script_is_never_go(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    good = str(DATA / "scripts" / "grpo_gsm8k.sh")
    missing = cli("audit", good, str(tmp_path / "missing.sh"), "--format", "json")
    assert (missing.code, missing.out) == (2, ""), (
        "a path that does not exist: nothing is read, nothing written"
    )
    assert missing.err.startswith(f"error: {tmp_path / 'missing.sh'} does not exist")
    broken = tmp_path / "broken.sh"
    broken.write_text("python3 -m verl.trainer.main_ppo a='x\n")
    for argv in ((str(broken),), (good, str(broken))):
        result = cli("audit", *argv, "--format", "json")
        assert result.code == 2
        data = strict_loads(result.out)
        assert data["verdict"] == "input-error"
        assert any(script["error"] for script in data["scripts"])

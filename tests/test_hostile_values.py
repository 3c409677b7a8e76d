"""Values that used to pass silently: Hydra sweeps, a deleted section under a file, unreadable models and data."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
from conftest import CliResult, make_tiny_model

Cli = Callable[..., CliResult]
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "launch_examples" / "grpo_6gpu.yaml")
SWEEPS = [
    "actor_rollout_ref.actor.ppo_mini_batch_size=7,8",
    "data.train_batch_size=choice(1,2)",
    "data.train_batch_size=range(1,5)",
    "actor_rollout_ref.actor.optim.lr=interval(0.1,0.2)",
    "data.train_batch_size=shuffle(1,2)",
    "trainer.project_name=glob(*)",
    "model_engine=dp,megatron",
]


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def _hydra_refuses(token: str) -> bool:
    """Hydra's own check in a run without --multirun (verl's entry point): the oracle for what verl refuses."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from hydra.types import RunMode

    override = OverridesParser.create().parse_override(token)
    try:
        ConfigLoaderImpl.validate_sweep_overrides_legal([override], RunMode.RUN, from_shell=True)
    except ConfigCompositionException:
        return True
    return False


@pytest.mark.parametrize("token", SWEEPS)
@pytest.mark.parametrize("verb", ["check", "show", "run"])
def test_a_sweep_is_refused_naming_the_token(tmp_path: Path, cli: Cli, verb: str, token: str) -> None:
    assert _hydra_refuses(token)
    extra = ["--dry-run", "--run-dir", str(tmp_path / "rd")] if verb == "run" else []
    result = cli(verb, *extra, "-c", EXAMPLE, token)
    assert not (tmp_path / "rd").exists()  # verl's default is never written in its place
    first = result.err.splitlines()[0]
    assert result.code == 2
    assert first.startswith(f"error: '{token}' is a Hydra sweep")
    assert first.endswith(": verl runs one config and refuses it")


@pytest.mark.parametrize(
    ("token", "value"),
    [("trainer.project_name='a,b'", "a,b"), ("trainer.logger=[console,wandb]", "['console', 'wandb']")],
)
def test_a_quoted_string_or_a_list_is_not_a_sweep(cli: Cli, token: str, value: str) -> None:
    assert not _hydra_refuses(token)
    key = token.partition("=")[0]
    result = cli("show", token, "--key", key, "--format", "json")
    assert result.code == 0
    assert str(json.loads(result.out)["config"]) == value


def test_a_sweep_in_a_script_is_refused(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo \\\n    'data.train_batch_size=choice(1,2)' trainer.nnodes=1\n"
    )
    result = cli("audit", str(script))
    assert result.code == 2
    assert (
        "error: 'data.train_batch_size=choice(1,2)' is a Hydra sweep (choice(...))" in result.out + result.err
    )
    assert f"where: script, {script}:2" in result.out + result.err


def test_deleting_a_section_under_a_file_is_still_an_error(cli: Cli) -> None:
    result = cli("check", "-c", EXAMPLE, "~data")
    assert result.code == 1
    assert (
        "error [config-section] data was deleted (the 3 keys set below it afterwards do not restore verl's "
        "defaults): verl reads keys below data and stops"
    ) in result.out


@pytest.mark.parametrize("kind", ["fifo", "device", "invalid", "list", "deep"])
def test_an_unreadable_model_config_is_an_input_error(tmp_path: Path, cli: Cli, kind: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = model / "config.json"
    expected = {
        "fifo": f"error: {config} is a named pipe (FIFO), not a regular file",
        "device": f"error: {config} is a character device, not a regular file",
        "invalid": f"error: {config} is not valid JSON: Expecting ',' delimiter: line 1 column 19",
        "list": f"error: {config} holds list, not a JSON object",
        "deep": f"error: {config} is nested too deeply to be a model config",
    }[kind]
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "device":
        config.symlink_to("/dev/zero")
    else:
        config.write_text(
            {"invalid": '{"hidden_size": 1 "x": 2}', "list": "[1]", "deep": "[" * 100_000}[kind]
        )
    result = cli("check", "-c", EXAMPLE, f"actor_rollout_ref.model.path={model}")
    assert result.code == 2
    assert result.err.splitlines()[0].startswith(expected)


def test_a_valid_model_config_still_loads(tmp_path: Path, cli: Cli) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    result = cli("check", "-c", EXAMPLE, f"actor_rollout_ref.model.path={model}")
    assert result.code in (0, 1)
    assert "error:" not in result.err


def _data_file(tmp_path: Path, kind: str) -> Path:
    if kind == "device":
        return Path("/dev/zero")
    path = tmp_path / "train.parquet"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "corrupt":
        pq.write_table(pa.table({"prompt": ["x"] * 50}), path)
        path.write_bytes(path.read_bytes()[:-12])  # the footer gone, as after an interrupted copy
    return path


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("fifo", "it is a named pipe (FIFO), not a regular file"),
        ("device", "it is a character device, not a regular file"),
        ("corrupt", "it is not a readable parquet file ("),
    ],
)
def test_an_unreadable_data_file_is_a_finding(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch, kind: str, reason: str
) -> None:
    path = _data_file(tmp_path, kind)
    tokens = (f"data.train_files={path}", "data.prompt_key=nope")
    result = cli("check", "-c", EXAMPLE, *tokens)
    assert (
        f"warning [data-file-unreadable] data.train_files={path}: verl cannot load '{path}' (on this"
        in result.out
    )
    assert reason in result.out
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "6")
    result = cli("check", "-c", EXAMPLE, *tokens)
    assert result.code == 1
    assert (
        f"error [data-file-unreadable] data.train_files={path}: verl cannot load '{path}': {reason}"
        in result.out
    )


def test_an_env_interpolation_is_type_checked_resolved(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    result = cli("check", "-c", EXAMPLE, "data.train_batch_size=${oc.env:HOME}")
    assert result.code == 1
    assert (
        "error [type-mismatch] data.train_batch_size expects an integer (verl's default), got '/home/someone' "
        "(a string), from ${oc.env:HOME}"
    ) in result.out
    monkeypatch.setenv("BATCH", "60")
    result = cli("check", "-c", EXAMPLE, "data.train_batch_size=${oc.env:BATCH}")
    assert "type-mismatch" not in result.out

"""Data files: missing local files stop the pre-flight, remote ones are named, the prompt column is checked."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import run_preflight
from verl_safe_launch.presets import compose_for_launch


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


@pytest.fixture
def parquet(tmp_path: Path) -> Path:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+1?"}]], "data_source": ["x"]}), path)
    return path


def _data(*tokens: str) -> list[Finding]:
    findings = run_preflight(compose_for_launch(ComposeRequest(overrides=cli_tokens(list(tokens))))).findings
    return [f for f in findings if f.rule_id.startswith("data-")]


def test_missing_local_train_file_is_an_error_where_the_run_happens(
    tmp_path: Path, parquet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a Slurm allocation (GPUs detected here) the file must be on this machine."""
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    found = _data(f"data.train_files={tmp_path / 'nope.parquet'}", f"data.val_files={parquet}")
    assert [(f.rule_id, f.severity, f.keys) for f in found] == [
        ("data-files-missing", Severity.ERROR, ("data.train_files",))
    ]
    assert f"'{tmp_path / 'nope.parquet'}' is a local path and does not exist;" in found[0].message


def test_missing_local_file_elsewhere_cannot_be_verified(tmp_path: Path, parquet: Path) -> None:
    """Checked on a machine that is not where the job runs (a laptop, a login node): a warning, never NO-GO."""
    found = _data(f"data.train_files={tmp_path / 'nope.parquet'}", f"data.val_files={parquet}")
    assert [(f.rule_id, f.severity) for f in found] == [("data-files-missing", Severity.WARNING)]
    assert "does not exist on this machine (cannot verify where the job runs)" in found[0].message


def test_verls_placeholder_is_a_warning_and_remote_uris_are_info(parquet: Path) -> None:
    found = _data(f"data.train_files={parquet}", "data.val_files=hdfs://cluster/gsm8k/test.parquet")
    assert [(f.rule_id, f.severity) for f in found] == [("data-files-remote", Severity.INFO)]
    placeholder = _data(f"data.train_files={parquet}")
    assert [(f.rule_id, f.severity, f.keys) for f in placeholder] == [
        ("data-files-missing", Severity.WARNING, ("data.val_files",))
    ]


def test_prompt_key_must_be_a_parquet_column(parquet: Path) -> None:
    found = _data(f"data.train_files={parquet}", f"data.val_files={parquet}", "data.prompt_key=question")
    assert {(f.rule_id, f.fix) for f in found} == {("data-prompt-key-missing", "data.prompt_key=prompt")}
    assert "(columns: prompt, data_source)" in found[0].message
    assert _data(f"data.train_files={parquet}", f"data.val_files={parquet}") == []

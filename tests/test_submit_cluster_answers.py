"""What a cluster answers is hostile input too: malformed counts are exit 2, names and job ids are shown escaped,
and no secret's value goes into the run directory, job.json or the output.

A small HTTP server answers as a Ray dashboard does (version, node list, package check, job submission) and
Ray's own ``JobSubmissionClient`` and state API read it; a real Ray cluster cannot report a GPU count of "abc"
or a node name holding escape codes. The job it accepts is never run; test_submit.py runs real ones.
"""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import EXAMPLES, CliResult

GRPO = str(EXAMPLES / "grpo_6gpu.yaml")
WANDB = "wandb-0123456789abcdef-not-real"
HF = "hf_abcdefghijklmnopqrstuv_not_real"


def _node(name: str, gpus: object, accelerator: str = "H100") -> dict[str, Any]:
    return {
        "node_id": "ab12cd34ef56" * 4,
        "node_ip": name,
        "node_name": name,
        "is_head_node": True,
        "state": "ALIVE",
        "state_message": None,
        "resources_total": {
            "CPU": 64.0,
            "GPU": gpus,
            "memory": 512 * 2**30,
            f"accelerator_type:{accelerator}": 1.0,
        },
        "labels": {},
        "start_time_ms": 0,
        "end_time_ms": 0,
    }


class Dashboard(BaseHTTPRequestHandler):
    """Answers as a Ray dashboard: ``nodes`` and ``job_id`` are what the test makes it say."""

    nodes: ClassVar[list[dict[str, Any]]] = []
    job_id: ClassVar[str] = "raysubmit_1"
    submitted: ClassVar[list[dict[str, Any]]] = []

    def _json(self, data: object, status: int = 200) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/api/version"):
            self._json({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"})
        elif self.path.startswith("/api/v0/nodes"):
            listing = {"total": len(self.nodes), "num_after_truncation": len(self.nodes)}
            listing |= {"num_filtered": len(self.nodes), "result": self.nodes}
            listing |= {"partial_failure_warning": "", "warnings": []}
            self._json({"result": True, "msg": "", "data": {"result": listing}})
        elif self.path.startswith("/api/packages/"):
            self._json({}, 200)  # "already uploaded": nothing is sent
        else:
            self._json({}, 404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        type(self).submitted.append(json.loads(self.rfile.read(length)))
        self._json({"submission_id": self.job_id, "job_id": self.job_id})

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def dashboard(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    httpd.daemon_threads = True
    Dashboard.submitted = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _submit(cli: Callable[..., CliResult], address: str, run_dir: Path, *extra: str) -> CliResult:
    args = ("submit", "--address", address, "--no-wait", "--run-dir", str(run_dir), "-c", GRPO)
    return cli(*args, "hardware.gpu_memory_gb=80", *extra)


@pytest.mark.parametrize("gpus", ["abc", "nan", -6, [6]])
def test_a_cluster_reporting_a_gpu_count_that_is_not_one_is_exit_2(
    dashboard: str, cli: Callable[..., CliResult], tmp_path: Path, gpus: object
) -> None:
    Dashboard.nodes = [_node("10.0.0.2", gpus)]
    result = _submit(cli, dashboard, tmp_path / "run")
    assert result.code == 2, result.out + result.err
    assert 'the Ray cluster reported "GPU": ' in result.err and "not a count of resources" in result.err
    assert "Traceback" not in result.err and Dashboard.submitted == []


def test_names_and_job_ids_from_the_cluster_are_shown_escaped(
    dashboard: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    Dashboard.nodes = [_node("node\x1b[2J\u202e1", 6.0, accelerator="H100\u200b\x1b]0;pwned\x07")]
    Dashboard.job_id = "raysubmit_\x1b[8mhidden\u2066"
    result = _submit(cli, dashboard, tmp_path / "run")
    assert result.code == 0, result.out + result.err
    shown = result.out + result.err
    assert "\x1b" not in shown and "\u202e" not in shown and "\u200b" not in shown and "\u2066" not in shown
    assert "node\\x1b[2J\\u202e1" in shown and "H100\\u200b\\x1b]0;pwned\\x07" in shown
    assert "submitted job raysubmit_\\x1b[8mhidden\\u2066 to" in shown


def test_secrets_go_to_the_job_only_by_name_and_never_to_a_file_or_the_screen(
    dashboard: str, cli: Callable[..., CliResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    Dashboard.nodes = [_node("10.0.0.2", 6.0)]
    Dashboard.job_id = "raysubmit_2"
    run_dir = tmp_path / "run"
    # the secret reaches the config too, through an interpolation and through the shell
    result = _submit(
        cli,
        dashboard,
        run_dir,
        "--env-forward",
        "default,WANDB_API_KEY",
        "trainer.project_name=${oc.env:WANDB_API_KEY}",
        f"trainer.experiment_name=run-{HF}",
    )
    assert result.code == 0, result.out + result.err
    env_vars = Dashboard.submitted[0]["runtime_env"]["env_vars"]
    assert env_vars["WANDB_API_KEY"] == WANDB and env_vars["NCCL_DEBUG"] == "INFO"
    assert "HF_TOKEN" not in env_vars
    job = json.loads((run_dir / "job.json").read_text())
    assert job["secrets_forwarded"] == ["WANDB_API_KEY"] and job["secrets_not_forwarded"] == ["HF_TOKEN"]
    assert "NCCL_DEBUG" in job["env_forwarded"]
    assert "secrets not forwarded: HF_TOKEN" in result.out
    for path in run_dir.rglob("*"):
        text = path.read_text()
        assert WANDB not in text and HF not in text, path
    assert "${oc.env:WANDB_API_KEY}" in (run_dir / "config.yaml").read_text()
    assert "run-${oc.env:HF_TOKEN}" in (run_dir / "provenance.json").read_text()
    assert WANDB not in result.out + result.err and HF not in result.out + result.err
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "job.json").stat().st_mode) == 0o600


def test_env_forward_none_sends_nothing_and_a_missing_name_is_exit_2(
    dashboard: str, cli: Callable[..., CliResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    Dashboard.nodes = [_node("10.0.0.2", 6.0)]
    result = _submit(cli, dashboard, tmp_path / "run", "--env-forward", "none")
    assert result.code == 0, result.out + result.err
    assert Dashboard.submitted[0]["runtime_env"].get("env_vars", {}) == {}
    missing = _submit(cli, dashboard, tmp_path / "run2", "--env-forward", "default,NOT_SET_HERE")
    assert missing.code == 2 and "--env-forward names NOT_SET_HERE, which is not set here" in missing.err

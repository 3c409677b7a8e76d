"""submit to a real local Ray whose job Python lacks verl-safe-launch's dependencies: the cluster is named as the
problem (exit 3, what it lacks), never an internal error of ours."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import CliResult
from test_submit import _free_port, _small_run

from verl_safe_launch.backends import token_fix

# The module's Ray cluster starts once: under pytest-xdist the whole module runs on one worker.
pytestmark = pytest.mark.xdist_group("ray-bare")


@pytest.fixture(scope="module")
def bare_cluster() -> Iterator[str]:
    """One Ray node (2 declared GPUs) started with a bare virtual environment's ``python`` first on PATH."""
    from ray.cluster_utils import Cluster

    temp = Path(tempfile.mkdtemp(prefix="vslbare"))
    bare = temp / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    assert subprocess.run([bare / "bin" / "python", "-c", "import omegaconf"], check=False).returncode != 0
    port = _free_port()
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith(("RAY_", "VSL_"))]:
            mp.delenv(name)
        mp.setenv("HOME", str(temp / "home"))
        mp.setenv("RAY_TMPDIR", str(temp))  # Ray's address file goes here, not into a shared /tmp/ray
        mp.setenv("TMPDIR", str(temp))  # and the multiprocessing dirs a killed Ray process never removes
        (temp / "ray").mkdir()
        mp.setenv("PATH", f"{bare / 'bin'}{os.pathsep}{os.environ['PATH']}")  # the job's `python`
        head = {"num_cpus": 16, "num_gpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1"}
        made = Cluster(
            initialize_head=True,
            connect=False,
            # The head's job agent listens on 52365 unless told: a second Ray on this machine (another test
            # worker's) would take it, and the job API then answers "No available agent".
            head_node_args={
                **head,
                "dashboard_port": port,
                "dashboard_agent_listen_port": _free_port(),
                "temp_dir": str(temp / "ray"),
            },
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            made.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_head_without_our_dependencies_is_named_with_what_it_lacks(
    bare_cluster: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    args = _small_run(tmp_path, nodes=1)
    result = cli("submit", "--address", bare_cluster, "--run-dir", str(tmp_path / "run"), *args)
    assert result.code == 3, result.out + result.err
    assert "internal error" not in result.out + result.err
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient(bare_cluster)
    logs = [jobs.get_job_logs(j.submission_id) + str(j.message) for j in jobs.list_jobs()]
    assert "which verl-safe-launch needs" in str(logs), logs
    assert (
        "error: the cluster's Python lacks 'omegaconf', 'hydra', 'yaml', which verl-safe-launch needs"
        in result.err
    )
    assert (
        "fix: install verl-safe-launch with its dependencies into the Python that runs the cluster's Ray"
        in (result.err)
    )


def test_the_token_fix_names_the_token_file_that_was_sent(tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("abc\n")
    assert token_fix({"HOME": str(tmp_path)}).startswith(
        "the cluster refused the token from ~/.ray/auth_token: put the cluster's own token there"
    )
    assert token_fix({"HOME": str(tmp_path / "none")}).startswith(
        "the cluster wants a token: export RAY_AUTH_TOKEN"
    )

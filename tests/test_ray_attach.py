"""Attaching to a Ray address that never answers ends with one clear error at a deadline, and SIGTERM ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES

from verl_safe_launch.errors import UsageError
from verl_safe_launch.launch.verl_handoff import attach_timeout

DEAD = "127.0.0.1:1"


def launcher(tmp_path: Path, timeout: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ADDRESS=DEAD, VSL_RAY_ATTACH_TIMEOUT=timeout, HOME=str(tmp_path))
    command = [str(Path(sys.executable).with_name("verl-safe-launch")), "run", "--force"]
    return [*command, "-c", str(EXAMPLES / "grpo_6gpu.yaml"), "--run-dir", str(tmp_path / "run")], env


@pytest.mark.slow
def test_an_address_that_never_answers_is_a_usage_error_at_the_deadline(tmp_path: Path) -> None:
    command, env = launcher(tmp_path, "3")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: no Ray cluster answered at {DEAD} (RAY_ADDRESS): no answer within 3 s" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigterm_ends_an_attach_that_is_still_waiting(tmp_path: Path) -> None:
    command, env = launcher(tmp_path, "600")
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("launching:"):
                break
        time.sleep(5)  # past importing Ray: inside ray.init's attach
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)  # far below the 600 s deadline: SIGTERM, not the deadline, ended it
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == -signal.SIGTERM


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "0", "1e9", "soon"])
def test_the_attach_deadline_must_be_a_number_of_seconds(text: str) -> None:
    with pytest.raises(UsageError, match="VSL_RAY_ATTACH_TIMEOUT"):
        attach_timeout({"VSL_RAY_ATTACH_TIMEOUT": text})
    assert attach_timeout({}) == 60.0
    assert attach_timeout({"VSL_RAY_ATTACH_TIMEOUT": "2.5"}) == 2.5

"""Before a local Ray starts, ``run`` checks that this machine can load the model; failures never read empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT, make_tiny_model

from verl_safe_launch.launch import describe_exception, model_access_error

MISSING = "some-org/not-a-model-here"


def _cache_with_config(hub: Path, repo_id: str) -> None:
    """The Hugging Face cache layout for one cached file: refs/main → snapshots/<rev>/config.json."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


def test_a_local_directory_and_a_cached_id_pass(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    assert model_access_error(str(model), {}, tmp_path) is None
    hub = tmp_path / "hub"
    _cache_with_config(hub, "org/cached-model")
    assert (
        model_access_error("org/cached-model", {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}, tmp_path)
        is None
    )


def test_offline_and_not_cached_is_decided_by_the_cache(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    error = model_access_error(MISSING, env, tmp_path / "run")
    assert error is not None
    assert error.what == (
        f"{MISSING} is not in the local Hugging Face cache ({tmp_path / 'hub'}) and HF_HUB_OFFLINE=1 keeps verl "
        "off the hub (decided by the cache alone)"
    )
    assert error.where == f"actor_rollout_ref.model.path={MISSING}; run directory {tmp_path / 'run'}"


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    error = model_access_error(str(tmp_path / "nope"), {}, tmp_path)
    assert (
        error is not None
        and error.what == f"the model directory {tmp_path / 'nope'} does not exist on this machine"
    )


def test_hydras_instantiation_error_of_verls_model_config_keeps_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's HFModelConfig built by Hydra, as verl builds it, for a model this machine cannot load."""
    from hydra.utils import instantiate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(Exception) as caught:
        instantiate({"_target_": "verl.workers.config.model.HFModelConfig", "path": MISSING})
    assert str(caught.value).splitlines()[0].endswith(":"), "Hydra puts the reason on the next line"
    line = describe_exception(caught.value)
    assert line.startswith("InstantiationException: Error in call to target")
    assert not line.endswith(":") and len(line.split("HFModelConfig':", 1)[1].strip()) > 0


def test_an_empty_message_is_replaced_by_the_type_and_its_cause() -> None:
    try:
        try:
            raise OSError("no route to host")
        except OSError as inner:
            raise RuntimeError() from inner
    except RuntimeError as exc:
        assert describe_exception(exc) == "RuntimeError (caused by OSError: no route to host)"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RAY_", "VSL_", "CUDA_"))}
    clean.update(HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"), VSL_HARDWARE_DETECT="0", **env)
    command = [
        f"{Path(sys.executable).parent}/verl-safe-launch",
        "run",
        "--force",
        "-c",
        str(EXAMPLES / "grpo_6gpu.yaml"),
        f"actor_rollout_ref.model.path={MISSING}",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    return subprocess.run(
        command, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 keeps verl off the hub (decided by the cache alone)"),
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub does not serve it to this machine: ConnectError"),
    ],
)
def test_run_force_stops_before_ray_when_the_model_is_out_of_reach(
    tmp_path: Path, env: dict[str, str], said: str
) -> None:
    done = _run(tmp_path, **env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert said in done.stderr and f"run directory {tmp_path / 'run'}" in done.stderr
    assert "launching:" not in done.stdout, "nothing was started"
    assert "Traceback" not in done.stderr

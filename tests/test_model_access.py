"""Before a local Ray starts, ``run`` checks that this machine can load the model; failures never read empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT, make_tiny_model

from verl_safe_launch.inputs import generate_model_files
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
    model = make_tiny_model(tmp_path / "tiny", weights=True)
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


def test_a_directory_without_tokenizer_or_weights_is_refused(tmp_path: Path) -> None:
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text((make_tiny_model(tmp_path / "tiny") / "config.json").read_text())
    error = model_access_error(str(only_config), {}, tmp_path / "run")
    assert error is not None
    assert error.what == (
        f"the model directory {only_config} has no tokenizer (tokenizer.json, tokenizer.model, vocab.json, ...); "
        "no weights (model.safetensors, pytorch_model.bin, model.safetensors.index.json, "
        "pytorch_model.bin.index.json): verl's workers load them after Ray starts"
    )


def test_an_index_names_shards_that_must_be_there(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "sharded")
    index = {
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
        }
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    error = model_access_error(str(model), {}, tmp_path)
    assert (
        error is not None
        and "the shards model.safetensors.index.json lists: model-00002-of-00002.safetensors" in error.what
    )


def test_a_tokenizer_transformers_cannot_load_is_refused(tmp_path: Path) -> None:
    """transformers' own AutoTokenizer decides, as in verl's workers: a corrupt tokenizer.json is refused."""
    model = make_tiny_model(tmp_path / "broken", weights=True)
    assert model_access_error(str(model), {}, tmp_path) is None
    (model / "tokenizer.json").write_text("{not json")
    error = model_access_error(str(model), {}, tmp_path)
    assert error is not None and error.what.startswith(f"the tokenizer in {model} does not load: ")


def test_the_file_names_are_transformers_own() -> None:
    """data/model_files.json is what the installed transformers names (regenerated and compared)."""
    shipped = json.loads((ROOT / "verl_safe_launch" / "data" / "model_files.json").read_text())
    assert generate_model_files() == shipped


@pytest.mark.slow
def test_run_stops_before_ray_and_check_warns_for_a_config_only_directory(tmp_path: Path) -> None:
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text((make_tiny_model(tmp_path / "tiny") / "config.json").read_text())
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RAY_", "VSL_", "CUDA_"))}
    clean.update(HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"), VSL_HARDWARE_DETECT="0")
    args = ["-c", str(EXAMPLES / "grpo_6gpu.yaml"), f"actor_rollout_ref.model.path={only_config}"]
    exe = f"{Path(sys.executable).parent}/verl-safe-launch"
    run = [exe, "run", "--force", *args, "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(run, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"error: the model directory {only_config} has no tokenizer" in done.stderr
    assert "launching:" not in done.stdout and "Traceback" not in done.stderr
    check = subprocess.run(
        [exe, "check", *args, "hardware.gpus_per_node=6"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (
        f"warning [model-files-missing] actor_rollout_ref.model.path={only_config}: the directory has no"
        in check.stdout
    )

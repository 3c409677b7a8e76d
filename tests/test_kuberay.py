"""kuberay: the RayJob validates against KubeRay's CRD schema (strictly) and asks for the GPUs the config needs."""

from __future__ import annotations

import gzip
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from verl_safe_launch.cli import main

CRD = Path(__file__).parent / "data" / "kuberay" / "ray.io_rayjobs.yaml.gz"
EXAMPLES = Path(__file__).parent.parent / "launch_examples"


def _strict(schema: Any) -> Any:
    """Refuse unknown fields where the CRD lists the properties (as 'kubectl apply --validate=strict' does)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def _write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, list[dict[str, Any]], str]:
    out = tmp_path / "job.yaml"
    code = main(
        [
            "kuberay",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--image",
            "verlai/verl:latest",
            "-o",
            str(out),
            "-c",
            str(EXAMPLES / "grpo_6gpu.yaml"),
            "trainer.n_gpus_per_node=8",
            "trainer.nnodes=2",
            "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            *extra,
        ]
    )
    text = capsys.readouterr().out
    docs = list(yaml.safe_load_all(out.read_text())) if out.exists() else []
    return code, docs, text


def test_rayjob_validates_against_the_crd_and_provides_16_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], validator: jsonschema.Draft7Validator
) -> None:
    code, docs, text = _write(
        tmp_path, capsys, "--namespace", "rl", "--toleration", "nvidia.com/gpu:NoSchedule"
    )
    assert code == 0, text
    config_map, job = docs
    errors = sorted(validator.iter_errors(job), key=lambda e: list(e.path))
    assert errors == [], [f"{list(e.path)}: {e.message}" for e in errors]
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(
        int(g["replicas"])
        * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in workers
    )
    assert gpus == 16
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:5] == ["python", "-m", "verl_safe_launch", "run", "--attach"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["trainer.nnodes"] == 2 and config["trainer.n_gpus_per_node"] == 8
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in head["volumes"]
    assert head["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "GiB each (host RAM estimate ~" in text  # the pods' memory comes from the host RAM estimate


def test_the_schema_check_is_strict(validator: jsonschema.Draft7Validator) -> None:
    bad = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "spec": {"entrypoint": "x", "shutdownAfterJobFinish": True},
    }
    assert list(validator.iter_errors(bad))


def test_refuses_a_config_the_pods_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, docs, text = _write(tmp_path, capsys, "trainer.nnodes=4")
    assert code == 1 and docs == []
    assert "hardware-mismatch" in text


def test_never_overwrites_and_checks_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "job.yaml").write_text("mine\n")
    assert _write(tmp_path, capsys)[0] == 2
    assert (tmp_path / "job.yaml").read_text() == "mine\n"
    assert _write(tmp_path, capsys, "--force", "--name", "Bad_Name")[0] == 2
    assert _write(tmp_path, capsys, "--force", "--toleration", "gpu")[0] == 2


@pytest.mark.parametrize(
    ("flag", "value", "ok"),
    [
        ("--namespace", "rl-team", True),
        ("--namespace", "RL", False),
        ("--namespace", "rl.team", False),  # a label: no dots
        ("--namespace", "-rl", False),
        ("--namespace", "a" * 63, True),
        ("--namespace", "a" * 64, False),
        ("--namespace", "rl\nkind: Secret", False),
        ("--service-account", "ray.workers-1", True),
        ("--service-account", "ray_workers", False),
        ("--service-account", "ray..workers", False),
        ("--service-account", "a" * 254, False),
        ("--service-account", "x: y", False),
    ],
)
def test_namespace_and_service_account_are_dns_1123_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, ok: bool
) -> None:
    if ok:
        assert _write(tmp_path, capsys, flag, value)[0] == 0
        return
    out = tmp_path / "job.yaml"
    code = main(
        [
            "kuberay",
            "--nodes",
            "1",
            "--gpus-per-node",
            "6",
            "--image",
            "verl",
            "-o",
            str(out),
            f"{flag}={value}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert f"error: {flag} {value!r} is not a valid Kubernetes name" in err and "DNS-1123" in err

"""Render a KubeRay ``RayJob`` (ray.io/v1) that runs the pre-flighted launch on Kubernetes, sized from the config."""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from verl_safe_launch.errors import UsageError
from verl_safe_launch.launch import NodeNeed

CONFIG_MOUNT = "/vsl"
CONFIG_FILE = "config.yaml"
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")
_LABEL_TEXT = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_LABEL = re.compile(_LABEL_TEXT)
_SUBDOMAIN = re.compile(rf"{_LABEL_TEXT}(?:\.{_LABEL_TEXT})*")
# A heuristic for the host memory of a GPU pod when none is given: room for the dataloader, the Ray object
# store and CPU-side copies, per GPU, plus a fixed base (override it with --memory-gb).
MEMORY_PER_GPU_GB = 32
MEMORY_BASE_GB = 16
HEAD_CPUS_MIN = 2
HEAD_MEMORY_GB = 16
SHM_FRACTION = 0.3


@dataclass(frozen=True)
class KubeRaySpec:
    """What the RayJob asks Kubernetes for, and where its pods may run."""

    name: str
    image: str
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    head_cpus: int
    memory_gb: int
    namespace: str | None = None
    service_account: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict[str, str], ...] = field(default=())
    ttl_seconds: int = 600


def check_name(name: str) -> str:
    """A Kubernetes object name (DNS-1123 label, short enough for KubeRay's derived names)."""
    if not _DNS1123.fullmatch(name):
        raise UsageError(
            f"'{name}' is not a valid Kubernetes name",
            where="--name",
            fix="lower-case letters, digits and '-', starting and ending with a letter or digit, at most 52",
        )
    return name


def check_reference(value: str | None, flag: str) -> str | None:
    """``--namespace`` (a DNS-1123 label, at most 63) or ``--service-account`` (a DNS-1123 subdomain, at most
    253), as the API server validates them; None passes."""
    if value is None:
        return None
    label = flag == "--namespace"
    pattern, most = (_LABEL, 63) if label else (_SUBDOMAIN, 253)
    if pattern.fullmatch(value) and len(value) <= most:
        return value
    kind = "label" if label else "subdomain"
    dots = "" if label else " (dot-separated parts allowed)"
    raise UsageError(
        f"{flag} {value!r} is not a valid Kubernetes name: it must be a DNS-1123 {kind}",
        where=flag,
        fix=f"lower-case letters, digits and '-', starting and ending with a letter or digit{dots}, at most {most}",
    )


def parse_selector(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``key=value`` pairs of ``--node-selector``."""
    out: list[tuple[str, str]] = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--node-selector {item!r} is not KEY=VALUE", where="--node-selector")
        out.append((key, value))
    return tuple(out)


def parse_toleration(items: Sequence[str]) -> tuple[dict[str, str], ...]:
    """``KEY[=VALUE]:EFFECT`` (as kubectl taint writes it) → a toleration."""
    out: list[dict[str, str]] = []
    for item in items:
        head, sep, effect = item.rpartition(":")
        if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or not head:
            raise UsageError(
                f"--toleration {item!r} is not KEY[=VALUE]:EFFECT",
                where="--toleration",
                fix="e.g. --toleration nvidia.com/gpu:NoSchedule (effect NoSchedule, PreferNoSchedule or NoExecute)",
            )
        key, eq, value = head.partition("=")
        entry = {"key": key, "operator": "Equal" if eq else "Exists", "effect": effect}
        if eq:
            entry["value"] = value
        out.append(entry)
    return tuple(out)


def sized(need: NodeNeed, nodes: int, gpus: int, memory_gb: int | None) -> tuple[int, int, int]:
    """CPUs per GPU pod (verl's bundles), CPUs of the head (TransferQueue and task runner), memory per GPU pod."""
    cpus = max(need.cpus_per_node, 1)
    head = max(need.extra_cpus, HEAD_CPUS_MIN)
    memory = memory_gb if memory_gb is not None else MEMORY_BASE_GB + MEMORY_PER_GPU_GB * gpus
    return cpus, head, memory


def render(spec: KubeRaySpec, config_yaml: str, overrides: Sequence[str] = ()) -> str:
    """The ConfigMap holding the resolved config, then the RayJob; deterministic YAML."""
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(f"{spec.name}-config", spec),
        "data": {CONFIG_FILE: config_yaml},
    }
    docs = [config_map, rayjob(spec, overrides)]
    return "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=1000) for d in docs)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config) as literal blocks, so the ConfigMap reads like the YAML it holds."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def entrypoint(overrides: Sequence[str] = ()) -> str:
    """The job's driver: the pre-flighted config (and the tokens a YAML cannot hold), attached to the job's cluster."""
    words = ["python", "-m", "verl_safe_launch", "run", "--attach", "-c", f"{CONFIG_MOUNT}/{CONFIG_FILE}"]
    return shlex.join([*words, "--run-dir", "/tmp/vsl-run", *overrides])


def rayjob(spec: KubeRaySpec, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The ``RayJob`` object (ray.io/v1)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _metadata(spec.name, spec),
        "spec": {
            "entrypoint": entrypoint(overrides),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": spec.ttl_seconds,
            "rayClusterSpec": {
                "headGroupSpec": {
                    "rayStartParams": {
                        "num-cpus": str(spec.head_cpus),
                        "num-gpus": "0",
                        "dashboard-host": "0.0.0.0",
                    },
                    "template": _pod(spec, "ray-head", spec.head_cpus, HEAD_MEMORY_GB, 0),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "gpu",
                        "replicas": spec.nodes,
                        "minReplicas": spec.nodes,
                        "maxReplicas": spec.nodes,
                        "rayStartParams": {
                            "num-cpus": str(spec.cpus_per_node),
                            "num-gpus": str(spec.gpus_per_node),
                        },
                        "template": _pod(
                            spec, "ray-worker", spec.cpus_per_node, spec.memory_gb, spec.gpus_per_node
                        ),
                    }
                ],
            },
        },
    }


def _metadata(name: str, spec: KubeRaySpec) -> dict[str, Any]:
    data: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "verl-safe-launch"}}
    if spec.namespace:
        data["namespace"] = spec.namespace
    return data


def _pod(spec: KubeRaySpec, name: str, cpus: int, memory_gb: int, gpus: int) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": str(cpus), "memory": f"{memory_gb}Gi"}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    shm = max(1, math.floor(memory_gb * SHM_FRACTION))
    pod: dict[str, Any] = {
        "containers": [
            {
                "name": name,
                "image": spec.image,
                "resources": {"limits": dict(amounts), "requests": dict(amounts)},
                "volumeMounts": [
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "vsl-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                ],
            }
        ],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm}Gi"}},
            {"name": "vsl-config", "configMap": {"name": f"{spec.name}-config"}},
        ],
    }
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.tolerations]
    return {"spec": pod}

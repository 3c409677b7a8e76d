"""``kuberay``: pre-flight for N pods × G GPUs, then write a KubeRay RayJob (and its ConfigMap) that runs the launch."""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Sequence

from verl_safe_launch.backends import (
    KubeRaySpec,
    check_name,
    check_reference,
    kuberay,
    parse_selector,
    parse_toleration,
    slurm,
)
from verl_safe_launch.cli._common import add_compose_args, compose_for_allocation, make_parser, parse
from verl_safe_launch.context import RuleContext
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, InputError, UsageError
from verl_safe_launch.files import output_path, write_atomic
from verl_safe_launch.launch import node_need
from verl_safe_launch.memory import estimate_memory
from verl_safe_launch.preflight import launch_preflight
from verl_safe_launch.render import escape, render_findings_text

EXAMPLES = """\
  verl-safe-launch kuberay --nodes 2 --gpus-per-node 8 --image verlai/verl:latest -o job.yaml preset=cluster \\
      actor_rollout_ref.model.path=Qwen/Qwen2.5-72B-Instruct data.train_files=s3://bucket/train.parquet
  kubectl apply -f job.yaml

Writes a ConfigMap with the config the job runs (every value set above verl's defaults) and a ray.io/v1 RayJob:
a CPU head (the job's driver, the TransferQueue) and N GPU pods with nvidia.com/gpu = G each, /dev/shm as a
memory-backed volume, the config mounted at /vsl. The image must hold verl and verl-safe-launch. The job runs
'verl-safe-launch run --attach', so the pre-flight, the memory hooks and the post-mortem run in the cluster.
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``kuberay``."""
    parser = make_parser("kuberay", "Write a KubeRay RayJob that runs the pre-flighted launch.", EXAMPLES)
    parser.add_argument("--nodes", type=int, required=True, metavar="N", help="GPU pods (Ray worker nodes)")
    parser.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="GPUs per pod")
    parser.add_argument("--image", required=True, help="container image holding verl and verl-safe-launch")
    parser.add_argument(
        "-o", "--output", required=True, type=output_path, metavar="FILE.yaml", help="where to write"
    )
    parser.add_argument("--name", default="verl", help="the RayJob's name (default verl)")
    parser.add_argument("--namespace", help="Kubernetes namespace")
    parser.add_argument("--service-account", help="pods' service account")
    parser.add_argument(
        "--node-selector", action="append", default=[], metavar="KEY=VALUE", help="repeatable"
    )
    parser.add_argument(
        "--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT", help="repeatable"
    )
    parser.add_argument(
        "--memory-gb",
        type=int,
        help="memory per GPU pod (default: the host RAM estimate + 25%%, else 16 + 32 per GPU)",
    )
    parser.add_argument("--ttl", type=int, default=600, metavar="SECONDS", help="ttlSecondsAfterFinished")
    parser.add_argument("--force", action="store_true", help="overwrite FILE.yaml")
    add_compose_args(parser)
    ns = parse(parser, args)
    for flag, value in (("--nodes", ns.nodes), ("--gpus-per-node", ns.gpus_per_node), ("--ttl", ns.ttl + 1)):
        if value < 1:
            raise UsageError(f"{flag} must be positive, got {value}", where=flag)
    if ns.memory_gb is not None and ns.memory_gb < 1:
        raise UsageError(f"--memory-gb must be positive, got {ns.memory_gb}", where="--memory-gb")
    name = check_name(ns.name)
    check_reference(ns.namespace, "--namespace")
    check_reference(ns.service_account, "--service-account")
    composed, profile = compose_for_allocation(ns, args, offset, "kuberay")
    pre = launch_preflight(composed, "kuberay", profile)
    print(render_findings_text(pre.findings).rstrip("\n"))
    if not pre.ok:
        print("Nothing was written: fix the errors above.")
        return EXIT_PREFLIGHT
    if ns.output.exists() and not ns.force:
        raise InputError(
            f"{ns.output} already exists", where="-o/--output", fix="pass --force to overwrite it"
        )
    memory_gb, memory_why = _pod_memory(ns.memory_gb, pre.context)
    cpus, head, memory = kuberay.sized(node_need(composed.view), ns.nodes, ns.gpus_per_node, memory_gb)
    spec = KubeRaySpec(
        name,
        ns.image,
        ns.nodes,
        ns.gpus_per_node,
        cpus,
        head,
        memory,
        ns.namespace,
        ns.service_account,
        parse_selector(ns.node_selector),
        parse_toleration(ns.toleration),
        ns.ttl,
    )
    extra = slurm.argv_overrides(composed)
    values = slurm.render_user_yaml(slurm.user_layer(composed.view))
    body = "".join(line + "\n" for line in values.splitlines() if not line.startswith("#"))
    header = "# The verl config of a verl-safe-launch KubeRay job: every value set above verl's defaults.\n"
    text = kuberay.render(spec, header + body, extra)
    write_atomic(ns.output, text, force=ns.force, inputs=ns.config, where="-o/--output")
    why = memory_why or (
        f"the default of {kuberay.MEMORY_BASE_GB} GiB + {kuberay.MEMORY_PER_GPU_GB} GiB per GPU: no host RAM estimate"
    )
    print(
        escape(
            f"wrote {ns.output}: RayJob {name} with {ns.nodes} GPU pod(s) × {ns.gpus_per_node} GPUs "
            f"({ns.nodes * ns.gpus_per_node} GPUs), {cpus} CPUs and {memory} GiB each ({why}), "
            f"and ConfigMap {name}-config"
        )
    )
    print(escape(f"apply with: kubectl apply -f {shlex.quote(str(ns.output))}"), file=sys.stdout)
    return EXIT_OK


HOST_HEADROOM = 1.25
"""A pod's memory request over the host RAM estimate: the estimate's own band and what it leaves out."""


def _pod_memory(given: int | None, context: RuleContext) -> tuple[int | None, str | None]:
    """Memory per GPU pod: --memory-gb, else the per-node host RAM estimate plus headroom, else None (default)."""
    if given is not None:
        return given, "--memory-gb"
    host = estimate_memory(context).host
    if host is None or host.total <= 0:
        return None, None
    gib = math.ceil(host.total * HOST_HEADROOM)
    return gib, f"host RAM estimate ~{host.total:.0f} GiB per node + {HOST_HEADROOM - 1:.0%}"

"""``submit``: the pre-flight here, then the run on an existing Ray cluster through its job API."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from verl_safe_launch.backends import (
    DEFAULT_PREFIXES,
    JOB_CONFIG,
    JOB_FILE,
    AnswerTooLong,
    JobTarget,
    capped_answers,
    choose_forwarding,
    client,
    cluster_nodes,
    describe,
    entrypoint,
    env_forward_arg,
    final_code,
    follow,
    job_address,
    job_runtime_env,
    slurm,
    submit_job,
    wait,
)
from verl_safe_launch.cli._common import add_compose_args, compose_from_args, make_parser, parse
from verl_safe_launch.compose import Composed
from verl_safe_launch.environment import MISSING_FIX, MISSING_MARK
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, UsageError
from verl_safe_launch.findings import has_errors
from verl_safe_launch.launch import auth_env, node_findings, node_need, ray_auth, rundir
from verl_safe_launch.preflight import Preflight, launch_preflight
from verl_safe_launch.render import escape, escape_lines, render_findings_text

EXAMPLES = """\
  verl-safe-launch submit --address http://head:8265 -c launch_examples/grpo_6gpu.yaml --follow
  RAY_ADDRESS=http://head:8265 verl-safe-launch submit preset=cluster actor_rollout_ref.model.path=... --no-wait

The pre-flight runs here; then the cluster's alive nodes are read through Ray's state API and checked one by one
(each GPU node must hold trainer.n_gpus_per_node GPUs and their CPUs: verl places one bundle set per node and
otherwise waits forever). The run directory (config.yaml, provenance, pre-flight report) becomes the job's working
directory, and the job runs 'verl-safe-launch run --attach' on it, so the memory hooks and the post-mortem run on the
cluster. Exit: 0 the job succeeded (or was submitted, with --no-wait), 1 the pre-flight or the node check refused
it, 2 bad input or an unreachable cluster, 3 the job failed.
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``submit``."""
    parser = make_parser("submit", "Pre-flight, then submit the run to an existing Ray cluster.", EXAMPLES)
    parser.add_argument("--address", help="the cluster's job API (dashboard URL), else RAY_ADDRESS")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    mode.add_argument("--no-wait", action="store_true", help="return once the job is submitted")
    parser.add_argument(
        "--run-dir", type=rundir.run_dir_arg, help="run directory (default outputs/<date>/<time>)"
    )
    parser.add_argument("--force", action="store_true", help="submit past pre-flight and node-check errors")
    parser.add_argument(
        "--env-forward",
        type=env_forward_arg,
        metavar="NAMES",
        help="the variables the job gets: names or globs, comma-separated; 'default' (the default: set "
        f"variables starting {', '.join(DEFAULT_PREFIXES)}, secrets excepted) or 'none'; a secret "
        "(*TOKEN*, *KEY*, *SECRET*, *PASSWORD*...) only when named exactly",
    )
    add_compose_args(parser)
    ns = parse(parser, args)
    composed = compose_from_args(ns, args, offset)
    pre = launch_preflight(composed, "submit")
    print(render_findings_text(pre.findings).rstrip("\n"))
    if not pre.ok and not ns.force:
        print("Nothing was submitted: fix the errors above, or pass --force.")
        return EXIT_PREFLIGHT
    target = job_address(ns.address, os.environ, composed.view.get("ray_kwargs.ray_init.address"))
    try:
        with capped_answers(), auth_env(ray_auth(target.address, os.environ)):
            # a token in ~/.ray/auth_token is sent, as Ray's CLI would
            return _checked_submit(ns, args, composed, pre, target)
    except AnswerTooLong as exc:
        raise UsageError(
            f"the job API at {target.address} ({target.source}) {exc}",
            where=target.source,
            fix="check the address: it must be the Ray dashboard's URL (default port 8265)",
        ) from None


def _checked_submit(
    ns: argparse.Namespace, args: Sequence[str], composed: Composed, pre: Preflight, target: JobTarget
) -> int:
    job_client = client(target)
    nodes = cluster_nodes(target)
    checks = node_findings(nodes, node_need(composed.view), f"Ray cluster {target.address}")
    alive = [n for n in nodes if n.alive]
    print(escape(f"cluster {target.address} ({target.source}): {len(alive)} alive node(s)"))
    for node in alive:  # the cluster's answer: every name shown escaped
        print(
            escape(
                f"  {node.label}: {node.gpus:g} GPUs, {node.cpus:g} CPUs, {node.memory_gb:.0f} GiB"
                + (f", {node.accelerator}" if node.accelerator else "")
            )
        )
    if checks:
        print(render_findings_text(checks).rstrip("\n"))
    if has_errors(checks) and not ns.force:
        print("Nothing was submitted: the cluster cannot hold this run.")
        return EXIT_PREFLIGHT
    return _submit(ns, args, composed, pre, target, job_client)


def _submit(
    ns: argparse.Namespace,
    args: Sequence[str],
    composed: Composed,
    pre: Preflight,
    target: JobTarget,
    job_client: Any,
) -> int:
    forced = ["pre-flight errors"] if not pre.ok else []
    cfg = rundir.resolved_config(composed)
    with rundir.created_run_dir(ns.run_dir, ns.force, forced) as run_dir:
        rundir.write_run_dir(
            run_dir, cfg, composed, pre.findings, args, list(ns.overrides), forced, ns.config
        )
    values = {k: v for k, v in slurm.user_layer(composed.view).items() if k != "ray_kwargs.ray_init.address"}
    rundir.atomic_write(run_dir / JOB_CONFIG, slurm.render_user_yaml(values))
    command = entrypoint(JOB_CONFIG, slurm.argv_overrides(composed))
    forwarding = choose_forwarding(os.environ, ns.env_forward)
    for line in describe(forwarding):
        print(escape(line))
    job_id = submit_job(
        job_client, target, entrypoint=command, runtime_env=job_runtime_env(run_dir, forwarding.values)
    )
    record = {"address": target.address, "job_id": job_id, "entrypoint": command, **forwarding.record()}
    rundir.atomic_write(run_dir / JOB_FILE, json.dumps(record, indent=2) + "\n", mode=0o600)
    print(escape(f"run directory: {run_dir}"))
    print(escape(f"submitted job {job_id} to {target.address}"))
    print(
        escape(
            f"follow it with: ray job logs --address {shlex.quote(target.address)} {shlex.quote(job_id)} --follow"
        )
    )
    if ns.no_wait:
        return EXIT_OK
    if ns.follow:  # the job's own output, as the cluster sends it: control characters shown escaped
        status = follow(job_client, job_id, lambda text: print(escape_lines(text), end="", flush=True))
    else:
        status = wait(job_client, job_id, lambda text: print(escape(text), flush=True))
    print(escape(f"job {job_id} ended: {status}"), file=sys.stderr if status != "SUCCEEDED" else sys.stdout)
    if status != "SUCCEEDED":
        _explain_environment(job_client, job_id)
    return final_code(status)


def _explain_environment(job_client: Any, job_id: str) -> None:
    """A job that stopped because the cluster's Python lacks a dependency: say so in the last line."""
    try:
        logs = str(job_client.get_job_logs(job_id))
    except Exception:  # the logs are best effort: the status already says the job failed
        return
    line = next((text for text in logs.splitlines() if MISSING_MARK in text), None)
    if line is not None:
        print(
            escape(f"error: the cluster's Python {line.split('error: this Python ', 1)[-1]}"), file=sys.stderr
        )
        print(f"  fix: {MISSING_FIX}", file=sys.stderr)

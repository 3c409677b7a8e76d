"""``slurm``: pre-flight for the allocation, then write (and optionally submit) a multi-node Ray job."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from verl_safe_launch.backends import allocation_findings, slurm
from verl_safe_launch.cli._common import (
    add_compose_args,
    add_config_name_args,
    compose_for_allocation,
    compose_from_args,
    make_parser,
    parse,
    print_json,
)
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, LaunchError, UsageError
from verl_safe_launch.files import check_target, output_path, write_files
from verl_safe_launch.findings import Finding, has_errors
from verl_safe_launch.inputs import (
    detect_hardware,
)
from verl_safe_launch.preflight import launch_preflight
from verl_safe_launch.render import escape, json_document, render_findings_text

EXAMPLES = """\
  verl-safe-launch slurm --nodes 1 --gpus-per-node 6 --partition gpu --time 24:00:00 \\
      -c launch_examples/grpo_6gpu.yaml trainer.total_epochs=3 -o grpo.sbatch
  verl-safe-launch slurm --nodes 2 --gpus-per-node 8 --setup 'module load cuda/12.4' \\
      --setup 'source ~/venvs/verl/bin/activate' preset=cluster ... -o job.sbatch --submit
  verl-safe-launch slurm --nodes 1 --gpus-per-node 2 --run-arg=--dry-run -c my.yaml -o try.sbatch

inside the job, the script itself runs:
  verl-safe-launch slurm preflight -c JOB.yaml          the pre-flight against the Slurm allocation
  verl-safe-launch slurm wait-ray --address ADDR HOST...  wait until every node's Ray has joined
"""
IN_JOB_EXAMPLES = """\
  verl-safe-launch slurm preflight -c job.yaml
  verl-safe-launch slurm wait-ray --address 10.0.0.1:6379 --timeout 600 node001 node002
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``slurm`` (or one of the steps the generated job runs inside its allocation)."""
    if args and args[0] in IN_JOB:
        return IN_JOB[args[0]](args[1:], offset + 1)
    return _write_job(args, offset)


# --- writing the job -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = make_parser(
        "slurm",
        "Pre-flight the config for NODES × GPUS, then write an sbatch script (and the YAML it runs) that "
        "brings up Ray on every allocated node and runs the launch on the head node.",
        EXAMPLES,
    )
    job = parser.add_argument_group("the allocation (#SBATCH lines)")
    job.add_argument("--nodes", type=slurm.count_arg, default=1, metavar="N", help="nodes (default 1)")
    job.add_argument(
        "--gpus-per-node", type=slurm.count_arg, required=True, metavar="G", help="GPUs on every node"
    )
    job.add_argument(
        "--cpus-per-task",
        type=slurm.count_arg,
        metavar="C",
        help="CPUs per node, all of them Ray's (default: the Ray CPUs this run reserves per node)",
    )
    job.add_argument("--mem", type=slurm.mem_arg, help="sbatch --mem, e.g. 480G (K, M, G or T; M without)")
    job.add_argument("--time", type=slurm.time_arg, help="sbatch --time, e.g. 24:00:00 or 2-00:00:00")
    for flag in ("--partition", "--account", "--qos"):
        job.add_argument(flag, help=f"sbatch {flag}")
    job.add_argument("--job-name", default="verl", help="sbatch --job-name (default verl)")
    job.add_argument("--output", help="sbatch --output (default JOB-%%j.out beside the script)")
    nodes = parser.add_argument_group("on the nodes")
    nodes.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line every step runs on its node first (module load, source venv/bin/activate); "
        "repeatable, in order",
    )
    nodes.add_argument("--container", metavar="IMAGE", help="run every step inside this image")
    nodes.add_argument(
        "--container-runtime", choices=slurm.RUNTIMES, default="apptainer", help="(default apptainer)"
    )
    nodes.add_argument(
        "--run-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra option of 'verl-safe-launch run' in the job, e.g. --run-arg=--dry-run; repeatable",
    )
    nodes.add_argument(
        "--join-timeout",
        type=slurm.seconds_arg,
        default=slurm.DEFAULT_JOIN_TIMEOUT_S,
        metavar="SECONDS",
        help="fail when Ray is not up on every node within this time (default %(default)s)",
    )
    out = parser.add_argument_group("the files")
    out.add_argument(
        "-o", "--script", required=True, type=output_path, metavar="JOB.sbatch", help="script to write"
    )
    out.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    out.add_argument("--force", action="store_true", help="overwrite JOB.sbatch and JOB.yaml")
    add_compose_args(parser)
    add_config_name_args(parser)
    return parser


def _write_job(args: Sequence[str], offset: int) -> int:
    ns = parse(_parser(), args)
    script = ns.script.absolute()
    config = _config_path(script)
    for path in (script, config):
        check_target(path, force=ns.force, inputs=ns.config, where="command line (-o)")
    composed, profile = compose_for_allocation(ns, args, offset, "slurm")
    findings, cpus = allocation_findings(composed, profile, ns.cpus_per_task, ns.nodes)
    spec = _spec(ns, script, config, cpus, slurm.argv_overrides(composed))
    slurm.validate_spec(spec)
    if has_errors(findings):
        _report(ns, findings, {"status": "preflight-failed"})
        return EXIT_PREFLIGHT
    values = slurm.user_layer(composed.view)
    write_files(
        {config: (slurm.render_user_yaml(values), 0o644), script: (slurm.render_sbatch(spec), 0o755)},
        force=ns.force,
        inputs=ns.config,
        where="command line (-o)",
    )
    result: dict[str, object] = {"status": "written", "script": str(script), "config": str(config)}
    text = [
        f"wrote {script} ({ns.nodes} node(s) × {ns.gpus_per_node} GPUs, --cpus-per-task={cpus})",
        f"wrote {config} ({len(values)} values: the config the job runs)",
    ]
    if ns.submit:
        result["job_id"] = _submit(script)
        text.append(f"submitted batch job {result['job_id']}")
    else:
        text.append(f"submit with: sbatch {shlex.quote(str(script))}")
    _report(ns, findings, result, text)
    return EXIT_OK


def _config_path(script: Path) -> Path:
    config = script.with_suffix(".yaml")
    if config == script:
        raise UsageError(
            f"-o {script.name}: the script would overwrite the YAML it runs",
            where="command line (-o)",
            fix="name the script JOB.sbatch; JOB.yaml is written beside it",
        )
    return config


def _spec(
    ns: argparse.Namespace, script: Path, config: Path, cpus: int, overrides: tuple[str, ...]
) -> slurm.SlurmSpec:
    stem = script.parent / script.stem
    container = slurm.Container(ns.container, ns.container_runtime) if ns.container else None
    return slurm.SlurmSpec(
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        config=str(config),
        log_root=f"{stem}-logs",
        job_name=ns.job_name,
        cpus_per_task=cpus,
        mem=ns.mem,
        time=ns.time,
        partition=ns.partition,
        account=ns.account,
        qos=ns.qos,
        output=ns.output or f"{stem}-%j.out",
        setup=tuple(ns.setup),
        container=container,
        overrides=overrides,
        run_args=tuple(ns.run_arg),
        join_timeout_s=ns.join_timeout,
    )


def _submit(script: Path) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UsageError(
            "sbatch is not on PATH, so the job was written but not submitted",
            where="--submit",
            fix=f"submit it on a Slurm login node: sbatch {shlex.quote(str(script))}",
        )
    done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise LaunchError(
            f"sbatch refused the job: {detail[-1] if detail else f'exit status {done.returncode}'}",
            where=f"sbatch --parsable {shlex.quote(str(script))}",
            fix="fix the #SBATCH options (partition, account, time) and run sbatch again",
        )
    return done.stdout.strip().split(";", 1)[0]


def _report(
    ns: argparse.Namespace, findings: Sequence[Finding], result: dict[str, object], text: Sequence[str] = ()
) -> None:
    if ns.format == "json":
        print_json(json_document(result, findings))
        return
    print(render_findings_text(findings), end="")
    if result.get("status") == "preflight-failed":
        print("Nothing was written: the config cannot run on this allocation.")
    for line in text:
        print(escape(line))


# --- inside the job ----------------------------------------------------------------------------------------


def _preflight(args: Sequence[str], offset: int) -> int:
    """The pre-flight against the allocation this runs in (Slurm environment, nvidia-smi)."""
    from verl_safe_launch.backends import allocation_lines

    parser = make_parser("slurm preflight", "The pre-flight against the Slurm allocation.", IN_JOB_EXAMPLES)
    add_compose_args(parser)
    add_config_name_args(parser)
    ns = parse(parser, args)
    composed = compose_from_args(ns, args, offset)
    profile = detect_hardware(composed.tool)
    pre = launch_preflight(composed, "slurm", profile)
    if ns.format == "json":
        print_json(json_document({}, pre.findings))
    else:
        print("\n".join(allocation_lines(composed.view, profile, os.environ)))
        print(render_findings_text(pre.findings), end="")
    sys.stdout.flush()
    return EXIT_OK if pre.ok else EXIT_PREFLIGHT


def _wait_ray(args: Sequence[str], offset: int) -> int:
    """Wait until every host's Ray node has joined the job's cluster, or name the ones missing."""
    from verl_safe_launch.backends import slurm_job

    parser = make_parser("slurm wait-ray", "Wait until every node's Ray has joined.", IN_JOB_EXAMPLES)
    parser.add_argument("--address", required=True, help="the Ray head's GCS address (host:port)")
    parser.add_argument(
        "--timeout", type=slurm.seconds_arg, default=slurm.DEFAULT_JOIN_TIMEOUT_S, help="seconds"
    )
    parser.add_argument("hosts", nargs="+", metavar="HOST", help="the Slurm node names (Ray node names)")
    ns = parse(parser, args)
    start = time.monotonic()
    lister = slurm_job.ray_node_lister(ns.address, ns.timeout)
    result = slurm_job.wait_for_nodes(ns.hosts, lister, max(ns.timeout - (time.monotonic() - start), 0.0))
    if result.missing:
        raise slurm_job.missing_error(result, ns.hosts, ns.timeout)
    print(slurm_job.joined_line(result, ns.hosts), flush=True)
    return EXIT_OK


IN_JOB: dict[str, Callable[[Sequence[str], int], int]] = {"preflight": _preflight, "wait-ray": _wait_ray}

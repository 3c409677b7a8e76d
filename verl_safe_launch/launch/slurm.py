"""Render a Slurm batch script that brings up Ray on every allocated node and runs the pre-flighted launch."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.compose import Composed
from verl_safe_launch.config_view import ConfigView, is_missing
from verl_safe_launch.errors import UsageError
from verl_safe_launch.provenance import Layer

PROGRAM = "verl-safe-launch"
RUNTIMES = ("apptainer", "singularity", "pyxis")
DEFAULT_JOIN_TIMEOUT_S = 600
# sbatch reads '#SBATCH' lines with its own parser: a backslash escapes, a line cannot continue.
_SBATCH_UNSAFE = ("\n", "\r", "\0", "\\")


@dataclass(frozen=True)
class Container:
    """An image every step runs in, and the runtime that starts it."""

    image: str
    runtime: str = "apptainer"


@dataclass(frozen=True)
class SlurmSpec:
    """Everything the batch script says: the allocation, the files it reads and what runs on the nodes.

    ``config`` and ``log_root`` appear in the script as given (the command line passes absolute paths).
    ``overrides`` are the few tokens a YAML layer cannot hold (config-group choices, deletions);
    ``run_args`` are extra options of ``verl-safe-launch run`` (for example ``--dry-run``).
    """

    nodes: int
    gpus_per_node: int
    config: str
    log_root: str
    job_name: str = "verl"
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    output: str | None = None
    setup: tuple[str, ...] = ()
    container: Container | None = None
    overrides: tuple[str, ...] = ()
    run_args: tuple[str, ...] = ()
    join_timeout_s: int = DEFAULT_JOIN_TIMEOUT_S


def sbatch_options(spec: SlurmSpec) -> list[tuple[str, str]]:
    """The ``#SBATCH`` flags and values, sorted by flag."""
    options = {
        "--nodes": str(spec.nodes),
        "--ntasks-per-node": "1",
        "--gpus-per-node": str(spec.gpus_per_node),
        "--job-name": spec.job_name,
        "--cpus-per-task": None if spec.cpus_per_task is None else str(spec.cpus_per_task),
        "--mem": spec.mem,
        "--time": spec.time,
        "--partition": spec.partition,
        "--account": spec.account,
        "--qos": spec.qos,
        "--output": spec.output,
    }
    return sorted((flag, value) for flag, value in options.items() if value is not None)


MAX_NODES = 100_000
_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}")
_MEM = re.compile(r"[0-9]+[KMGT]?", re.IGNORECASE)
_WHOLE = re.compile(r"[0-9]{1,12}")


def count_arg(text: str) -> int:
    """A count option (``--nodes``, ``--gpus-per-node``, ``--cpus-per-task``): a whole number 1..100000."""
    if not _WHOLE.fullmatch(text) or not 1 <= int(text) <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to {MAX_NODES}")
    return int(text)


def time_arg(text: str) -> str:
    """``--time`` in one of Slurm's formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or UNLIMITED."""
    if text.upper() in ("UNLIMITED", "INFINITE") or _TIME.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a Slurm time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 24:00:00)"
    )


def mem_arg(text: str) -> str:
    """``--mem`` in Slurm's format: a whole number with an optional K, M, G or T suffix (megabytes without)."""
    if _MEM.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a Slurm memory size: a whole number with an optional K, M, G or T suffix (e.g. 480G)"
    )


def seconds_arg(text: str) -> int:
    """A timeout in whole seconds, at least 1."""
    if not _WHOLE.fullmatch(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds, at least 1")
    return int(text)


def validate_spec(spec: SlurmSpec) -> None:
    """Raise a UsageError for anything the script cannot say exactly."""
    if spec.nodes < 1 or spec.gpus_per_node < 1:
        raise UsageError(
            f"--nodes {spec.nodes} --gpus-per-node {spec.gpus_per_node}: both must be at least 1",
            where="command line (verl-safe-launch slurm)",
            fix="for example --nodes 2 --gpus-per-node 8",
        )
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise UsageError(f"--cpus-per-task {spec.cpus_per_task} must be at least 1", fix="--cpus-per-task 32")
    for flag, value in sbatch_options(spec):
        bad = next((c for c in _SBATCH_UNSAFE if c in value), None)
        if bad is not None or not value.strip():
            what = "is empty" if bad is None else f"contains {bad!r}"
            raise UsageError(
                f"{flag} {value!r} {what}, which an '#SBATCH' line cannot carry",
                where=f"command line ({flag})",
                fix=f"pass {flag} without line breaks or backslashes",
            )
    if spec.container is not None:
        _validate_container(spec, spec.container)


def _validate_container(spec: SlurmSpec, container: Container) -> None:
    if container.runtime not in RUNTIMES:
        raise UsageError(
            f"unknown container runtime '{container.runtime}'",
            where="command line (--container-runtime)",
            fix="use one of: " + ", ".join(RUNTIMES),
        )
    bad = [d for d in _binds(spec) if "," in d or ":" in d]
    if bad:
        flag = "--container-mounts" if container.runtime == "pyxis" else "--bind"
        raise UsageError(
            f"{bad[0]} contains ',' or ':', which {container.runtime}'s {flag} reads as separators",
            where="command line (-o)",
            fix="write the job into a directory without ',' or ':' in its path",
        )


def _array(name: str, items: Sequence[str]) -> str:
    return f"{name}=(" + " ".join(shlex.quote(item) for item in items) + ")"


def _container_arrays(spec: SlurmSpec) -> tuple[list[str], list[str]]:
    """(srun options, command prefix) that put every step inside the container."""
    if spec.container is None:
        return [], []
    image = spec.container.image
    binds = _binds(spec)
    if spec.container.runtime == "pyxis":
        return [f"--container-image={image}", "--container-mounts=" + ",".join(f"{d}:{d}" for d in binds)], []
    bind = [arg for d in binds for arg in ("--bind", d)]
    return [], [spec.container.runtime, "exec", "--nv", *bind, image]


def _binds(spec: SlurmSpec) -> list[str]:
    """The directories a container must see: the config's and the logs' (one when nested)."""
    dirs = sorted({_parent(spec.config), spec.log_root})
    return [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]


def _parent(path: str) -> str:
    head, _, _ = path.rpartition("/")
    return head or "."


def render_sbatch(spec: SlurmSpec) -> str:
    """The batch script: deterministic, ``#SBATCH`` flags sorted, every rendered value shell-quoted."""
    validate_spec(spec)
    header = ["#!/bin/bash"]
    header += [f"#SBATCH {flag}={shlex.quote(value)}" for flag, value in sbatch_options(spec)]
    srun_extra, wrap = _container_arrays(spec)
    variables = [
        f"VSL_CONFIG={shlex.quote(spec.config)}",
        f"VSL_LOG_ROOT={shlex.quote(spec.log_root)}",
        f"VSL_JOIN_TIMEOUT={int(spec.join_timeout_s)}",
        _array("VSL_OVERRIDES", spec.overrides),
        _array("VSL_RUN_ARGS", spec.run_args),
        _array("VSL_SRUN_CONTAINER", srun_extra),
        _array("VSL_WRAP", wrap),
        f"export VSL_SETUP={shlex.quote(chr(10).join(spec.setup))}",
    ]
    return "\n".join([*header, _INTRO, *variables, _BODY])


_INTRO = """\
#
# Written by verl-safe-launch slurm. Brings up Ray on every allocated node (head on the batch node, one
# worker per other node, each with the CPUs and GPUs Slurm allocated there), waits until every node has
# joined, then runs the pre-flighted launch on the head node. The verl config is the YAML named below:
# edit that, not this script. Needs bash >= 4.4, scontrol and srun (Slurm >= 20.11).
set -euo pipefail

# What this job runs. Every value is shell-quoted; overrides are only what a YAML layer cannot hold."""

_BODY = r"""
vsl_log() { echo "vsl: $*"; }
vsl_fail() {
  local code=$1
  shift
  echo "vsl: error: $*" >&2
  exit "$code"
}

# The allocation: the node list expanded into one array element per host.
VSL_NODELIST=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
mapfile -t VSL_HOSTS <<< "$VSL_NODELIST"
VSL_HEAD=${SLURMD_NODENAME:-${VSL_HOSTS[0]}}
VSL_WORKERS=()
for vsl_host in "${VSL_HOSTS[@]}"; do
  if [ "$vsl_host" != "$VSL_HEAD" ]; then VSL_WORKERS+=("$vsl_host"); fi
done
if [ "${#VSL_WORKERS[@]}" -ne $((${#VSL_HOSTS[@]} - 1)) ]; then
  vsl_fail 3 "the batch node $VSL_HEAD is not in the node list: ${VSL_HOSTS[*]}"
fi
VSL_RUN_ID="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
VSL_LOG_DIR="$VSL_LOG_ROOT/$VSL_RUN_ID"
mkdir -p "$VSL_LOG_DIR"
vsl_log "job $VSL_RUN_ID (job id-restart count): ${#VSL_HOSTS[@]} node(s) ${VSL_HOSTS[*]}, head $VSL_HEAD"
vsl_log "Ray node logs: $VSL_LOG_DIR"

# One auth mode for every Ray process and client of this job, with a token made for this job.
export RAY_AUTH_MODE=token
if [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  RAY_AUTH_TOKEN=$(od -An -vN32 -tx1 /dev/urandom | tr -d ' \n')
  export RAY_AUTH_TOKEN
fi
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
export PYTHONUNBUFFERED=1
VSL_RAY_TMP="${VSL_RAY_TMP_ROOT:-/tmp}/vsl-ray-$VSL_RUN_ID"

# What every step runs on its node: the setup lines, then one command. A Ray node gets exactly the CPUs
# and GPUs Slurm allocated to the step on that node, prints its address once it is up, and blocks.
read -r -d '' VSL_NODE <<'VSL_NODE_END' || true
set -eo pipefail
eval "$VSL_SETUP"
set -u
vsl_gpus() {
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
    echo "$SLURM_GPUS_ON_NODE"
  elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[0-9]' || true
  else
    echo 0
  fi
}
# The first port from $1 up that nothing on this node listens on (Ray's client server would die on 10001
# when another Ray head runs on the node).
vsl_free_port() {
  local port=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
  echo "$port"
}
vsl_ray() {
  local role=$1 host=$2 tmp=$3 cpus gpus code=0
  shift 3
  cpus=${SLURM_CPUS_ON_NODE:-${SLURM_CPUS_PER_TASK:-1}}
  gpus=$(vsl_gpus)
  echo "vsl: Ray $role on $host: --num-cpus=$cpus --num-gpus=$gpus" \
    "(SLURM_CPUS_ON_NODE=${SLURM_CPUS_ON_NODE:-unset} SLURM_GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-unset}" \
    "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset})"
  rm -f "$tmp/ray_current_cluster"
  ray start --block --node-name="$host" --temp-dir="$tmp" --num-cpus="$cpus" --num-gpus="$gpus" \
    --dashboard-agent-listen-port=0 --disable-usage-stats --log-style=record "$@" &
  vsl_ray_pid=$!
  trap 'kill -TERM "$vsl_ray_pid" 2>/dev/null || true; wait "$vsl_ray_pid" || true; exit 143' TERM INT
  until [ -s "$tmp/ray_current_cluster" ]; do
    if ! kill -0 "$vsl_ray_pid" 2>/dev/null; then
      wait "$vsl_ray_pid" || code=$?
      echo "vsl: error: ray start on $host exited with code $code before the node was up" >&2
      exit $((code ? code : 1))
    fi
    sleep 0.5
  done
  echo "vsl: ray-address $(cat "$tmp/ray_current_cluster")"
  wait "$vsl_ray_pid"
}
case "$1" in
  ray-head)
    shift
    vsl_ray head "$@" --ray-client-server-port="$(vsl_free_port $((20000 + ${SLURM_JOB_ID:-0} % 10000)))"
    ;;
  ray-worker) shift; vsl_ray worker "$@" ;;
  *) exec "$@" ;;
esac
VSL_NODE_END

# HOST COMMAND...: one task on HOST, sharing the allocation with the job's other steps. It becomes srun,
# so call it in a subshell or in the background: the PID is then srun's, which forwards signals to the step.
vsl_step() {
  local host=$1
  shift
  exec srun --nodes=1 --ntasks=1 --overlap --nodelist="$host" "${VSL_SRUN_CONTAINER[@]}" \
    "${VSL_WRAP[@]}" bash -c "$VSL_NODE" vsl-node "$@"
}

VSL_STEP_PIDS=()
VSL_STEP_HOSTS=()
VSL_STEP_LOGS=()
# ROLE HOST [ray start options]: a Ray node in the background, its output in the job's log directory.
vsl_ray_step() {
  local role=$1 host=$2 log
  shift 2
  log="$VSL_LOG_DIR/ray-$role-$host.log"
  vsl_step "$host" "ray-$role" "$host" "$VSL_RAY_TMP-$host" "$@" > "$log" 2>&1 &
  VSL_STEP_PIDS+=("$!")
  VSL_STEP_HOSTS+=("$host")
  VSL_STEP_LOGS+=("$log")
}

# The index of the first Ray step that has exited; fails while every one is up.
vsl_dead_step() {
  local i
  for i in "${!VSL_STEP_PIDS[@]}"; do
    if ! kill -0 "${VSL_STEP_PIDS[$i]}" 2>/dev/null; then
      echo "$i"
      return 0
    fi
  done
  return 1
}

# INDEX: report a Ray step that has exited, with the end of its log, and fail.
vsl_step_died() {
  echo "vsl: error: the Ray step on ${VSL_STEP_HOSTS[$1]} exited; the end of ${VSL_STEP_LOGS[$1]}:" >&2
  tail -n 20 "${VSL_STEP_LOGS[$1]}" >&2 || true
  exit 3
}

# PID: wait for it while every Ray step stays up; stop it and fail fast when one of them exits.
vsl_watch() {
  local pid=$1 dead code=0
  while kill -0 "$pid" 2>/dev/null; do
    if dead=$(vsl_dead_step); then
      kill -TERM "$pid" 2>/dev/null || true
      vsl_step_died "$dead"
    fi
    sleep 1
  done
  wait "$pid" || code=$?
  return "$code"
}

vsl_seconds_left() {
  local left=$((VSL_JOIN_TIMEOUT - SECONDS))
  echo $((left > 1 ? left : 1))
}

# On exit: stop every Ray step (srun forwards the signal), wait up to 30 s, then leave the rest to Slurm.
vsl_cleanup() {
  local code=$? i
  trap - EXIT
  if [ "${#VSL_STEP_PIDS[@]}" -gt 0 ]; then
    kill -TERM "${VSL_STEP_PIDS[@]}" 2>/dev/null || true
    for i in {1..30}; do
      kill -0 "${VSL_STEP_PIDS[@]}" 2>/dev/null || break
      sleep 1
    done
  fi
  vsl_log "job $VSL_RUN_ID finished with exit code $code"
  exit "$code"
}
trap vsl_cleanup EXIT
trap 'exit 143' TERM INT

# 1. The pre-flight, against what Slurm allocated, before anything starts.
vsl_log "pre-flight on $VSL_HEAD against this allocation, before Ray starts"
(vsl_step "$VSL_HEAD" verl-safe-launch slurm preflight -c "$VSL_CONFIG" "${VSL_OVERRIDES[@]}") ||
  vsl_fail $? "the pre-flight refused this config for this allocation; Ray was not started"

# 2. The Ray head on this node, then one worker per other node; poll until every node has joined.
SECONDS=0
vsl_ray_step head "$VSL_HEAD" --head --port=0 --include-dashboard=false
VSL_RAY_ADDRESS=
until VSL_RAY_ADDRESS=$(sed -n 's/^vsl: ray-address //p' "${VSL_STEP_LOGS[0]}") && [ -n "$VSL_RAY_ADDRESS" ]; do
  if vsl_dead=$(vsl_dead_step); then vsl_step_died "$vsl_dead"; fi
  if [ "$SECONDS" -ge "$VSL_JOIN_TIMEOUT" ]; then
    vsl_fail 3 "the Ray head on $VSL_HEAD was not up within ${VSL_JOIN_TIMEOUT}s (see ${VSL_STEP_LOGS[0]})"
  fi
  sleep 1
done
grep -m1 "^vsl: Ray head on " "${VSL_STEP_LOGS[0]}" || true
vsl_log "Ray head up on $VSL_HEAD at $VSL_RAY_ADDRESS"
for vsl_host in "${VSL_WORKERS[@]}"; do
  vsl_ray_step worker "$vsl_host" --address="$VSL_RAY_ADDRESS"
done
vsl_step "$VSL_HEAD" verl-safe-launch slurm wait-ray --address="$VSL_RAY_ADDRESS" \
  --timeout="$(vsl_seconds_left)" "${VSL_HOSTS[@]}" &
vsl_watch "$!" || vsl_fail $? "not every node joined the Ray cluster"

# 3. The launch on the head node, attached to this job's Ray cluster.
export RAY_ADDRESS=$VSL_RAY_ADDRESS
vsl_log "launch on $VSL_HEAD: verl-safe-launch run -c $VSL_CONFIG"
vsl_step "$VSL_HEAD" verl-safe-launch run -c "$VSL_CONFIG" --run-dir="$VSL_LOG_DIR/run" "${VSL_RUN_ARGS[@]}" \
  "${VSL_OVERRIDES[@]}" &
vsl_watch "$!" || vsl_fail $? "the launch failed"
"""


YAML_TITLE = (
    "# The verl config of a verl-safe-launch Slurm job: every value set above verl's defaults (preset, user\n"
    "# files, command line, hardware), as composed when the job was written. Read with: verl-safe-launch run -c\n"
)


def user_layer(view: ConfigView) -> dict[str, Any]:
    """Every leaf a layer above verl's defaults set, by dotted key: its final value, an interpolation as written."""
    values: dict[str, Any] = {}
    for key in sorted(view.keys()):
        prov = view.prov(key)
        if prov is None or prov.source.layer is Layer.VERL or is_missing(view.get(key)):
            continue
        values[key] = prov.interpolation if prov.interpolation is not None else view.get(key)
    return values


def argv_overrides(composed: Composed) -> tuple[str, ...]:
    """The overrides a YAML layer cannot hold: config-group choices and deletions, as written."""
    wrote_value = {write.source for write in composed.writes if not write.delete}
    return tuple(token.text for token in composed.verl_overrides if token.source not in wrote_value)


def render_user_yaml(values: dict[str, Any]) -> str:
    """The user layer as YAML (dotted keys, sorted), read back by composition as one user file."""
    import yaml

    body = yaml.safe_dump(values, sort_keys=True, default_flow_style=False, allow_unicode=True, width=2**20)
    return YAML_TITLE + body

#!/bin/bash
# vsl-template: sbatch
#
# Written by verl-safe-launch slurm. Brings up Ray on every allocated node (head on the batch node, one
# worker per other node, each with the CPUs and GPUs Slurm allocated there), waits until every node has
# joined, then runs the pre-flighted launch on the head node. The verl config is the YAML named below:
# edit that, not this script. Needs bash >= 4.4, scontrol and srun (Slurm >= 20.11).
set -euo pipefail

# What this job runs. Every value is shell-quoted; overrides are only what a YAML layer cannot hold.
# vsl-template: variables

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
VSL_RAY_ROOT="${VSL_RAY_TMP_ROOT:-/tmp}"
VSL_RAY_TMP="$VSL_RAY_ROOT/vsl-ray-$VSL_RUN_ID"
# Each node's Ray temp dir is $VSL_RAY_TMP-<node index>; Ray's longest socket path under it,
# <dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store, must fit in 107 bytes (AF_UNIX).
# A root that leaves no room is refused here, before any node starts, rather than by the first raylet.
vsl_socket="$VSL_RAY_TMP-$((${#VSL_HOSTS[@]} - 1))/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store"
vsl_socket_bytes=$(printf %s "$vsl_socket" | wc -c)
if [ "$vsl_socket_bytes" -gt 107 ]; then
  vsl_fail 3 "Ray's temp dir $VSL_RAY_TMP-N is too long: its socket paths would take $vsl_socket_bytes bytes," \
    "more than the 107 a Unix socket path may have; fix: export VSL_RAY_TMP_ROOT=<a directory of at most" \
    "$(($(printf %s "$VSL_RAY_ROOT" | wc -c) + 107 - vsl_socket_bytes)) bytes> before sbatch"
fi

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
  vsl_step "$host" "ray-$role" "$host" "$VSL_RAY_TMP-${#VSL_STEP_PIDS[@]}" "$@" > "$log" 2>&1 &
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

"""A throwaway Slurm cluster on this machine: its own munged, slurmctld and one slurmd per node, fake GPUs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "sinfo", "scancel", "squeue")
HOW_TO_ENABLE = (
    "Slurm is not installed (or this is not root): as root, 'apt-get install -y slurm-wlm' (Debian's package) "
    "enables the real-Slurm tests; with CI=true they are mandatory"
)
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def missing_requirement() -> str | None:
    """Why a local Slurm cannot be started here, or None when it can."""
    missing = [name for name in DAEMONS if _which(name) is None]
    if missing:
        return f"{HOW_TO_ENABLE} (missing: {', '.join(missing)})"
    if os.geteuid() != 0:
        return f"{HOW_TO_ENABLE} (fake GPU device nodes need mknod, so root)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


@dataclass
class Job:
    """A finished job: its state, exit code and the text of its output file."""

    job_id: str
    state: str
    exit_code: int
    log: str


@dataclass
class SlurmCluster:
    """A running local cluster; ``stop`` ends every daemon it started, by PID."""

    root: Path
    conf: Path
    nodes: tuple[str, ...]
    pid_files: list[Path] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment every Slurm client (sbatch, scontrol, srun in jobs) needs."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def sbatch(self, script: Path, *options: str, cwd: Path, env: Mapping[str, str] | None = None) -> str:
        """Submit a script; return the job id."""
        done = subprocess.run(
            [_cmd("sbatch"), "--parsable", *options, str(script)],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**self.env, **(env or {})},
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";", 1)[0]

    def wait(self, job_id: str, output: Path, timeout_s: float = 300) -> Job:
        """Poll until the job ends; its log is read from ``output``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            state = fields.get("JobState", "")
            if state in FINAL_STATES:
                code = int(fields.get("ExitCode", "1:0").split(":", 1)[0])
                return Job(job_id, state, code, output.read_text() if output.exists() else "")
            time.sleep(1)
        subprocess.run([_cmd("scancel"), job_id], env=self.env, check=False)
        raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict."""
        done = subprocess.run(
            [_cmd("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True, env=self.env
        )
        pairs = (item.split("=", 1) for item in done.stdout.split() if "=" in item)
        return {key: value for key, value in pairs}

    def stop(self) -> None:
        """Stop the daemons this cluster started (slurmd, slurmctld, munged), by the PIDs they wrote."""
        for pid_file in reversed(self.pid_files):
            pid = _read_pid(pid_file)
            if pid is not None:
                _terminate(pid)


def _cmd(name: str) -> str:
    path = _which(name)
    if path is None:
        raise FileNotFoundError(name)
    return path


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _terminate(pid: int, timeout_s: float = 20) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_cluster(
    root: Path, nodes: tuple[str, ...] = ("n1", "n2"), gpus: int = 2, cpus: int = 32
) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node under ``root``; every node has ``gpus`` fake GPUs.

    The nodes declare ``cpus`` CPUs (more than this machine has: Slurm trusts the config here), so a job can
    give Ray the logical CPUs a verl run reserves.
    """
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "dev", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o711, exist_ok=True)
    cluster = SlurmCluster(root, root / "slurm.conf", nodes)
    try:
        socket_path = _start_munged(root / "munge", cluster)
        _fake_gpus(root / "dev", len(nodes) * gpus)
        _write_conf(cluster, socket_path, gpus, cpus)
        _start_slurm(cluster)
        _wait_idle(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_munged(directory: Path, cluster: SlurmCluster) -> Path:
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket_path = directory / "munge.socket"
    pid_file = directory / "munged.pid"
    cluster.pid_files.append(pid_file)
    subprocess.run(
        [
            _cmd("munged"),
            "--force",
            f"--key-file={key}",
            f"--socket={socket_path}",
            f"--pid-file={pid_file}",
            f"--log-file={directory / 'munged.log'}",
            f"--seed-file={directory / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
    )
    return socket_path


def _fake_gpus(directory: Path, count: int) -> None:
    """Character devices with NVIDIA's major number: Slurm schedules them and sets CUDA_VISIBLE_DEVICES."""
    for index in range(count):
        device = directory / f"nvidia{index}"
        if not device.exists():
            os.mknod(device, 0o666 | 0o020000, os.makedev(195, index))


def _write_conf(cluster: SlurmCluster, munge_socket: Path, gpus: int, cpus: int) -> None:
    root = cluster.root
    host = socket.gethostname().split(".", 1)[0]
    lines = [
        "ClusterName=vsltest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MpiDefault=none",
        "GresTypes=gpu",
        "KillWait=5",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
    ]
    gres = ["AutoDetect=off"]
    for index, node in enumerate(cluster.nodes):
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus} "
            f"RealMemory=8000 Gres=gpu:{gpus} State=UNKNOWN"
        )
        first = index * gpus
        gres.append(f"NodeName={node} Name=gpu File={root / 'dev'}/nvidia[{first}-{first + gpus - 1}]")
    lines.append(f"PartitionName=debug Nodes={','.join(cluster.nodes)} Default=YES MaxTime=INFINITE State=UP")
    cluster.conf.write_text("\n".join(lines) + "\n")
    (root / "gres.conf").write_text("\n".join(gres) + "\n")


def _start_slurm(cluster: SlurmCluster) -> None:
    conf = str(cluster.conf)
    cluster.pid_files.append(cluster.root / "slurmctld.pid")
    subprocess.run([_cmd("slurmctld"), "-i", "-f", conf], check=True, env=cluster.env, capture_output=True)
    for node in cluster.nodes:
        cluster.pid_files.append(cluster.root / f"slurmd-{node}.pid")
        subprocess.run(
            [_cmd("slurmd"), "-N", node, "-f", conf], check=True, env=cluster.env, capture_output=True
        )


def _wait_idle(cluster: SlurmCluster, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    states = ""
    while time.monotonic() < deadline:
        done = subprocess.run(
            [_cmd("sinfo"), "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=cluster.env
        )
        states = done.stdout.strip()
        if done.returncode == 0 and all(f"{node} idle" in states for node in cluster.nodes):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the local Slurm nodes did not become idle: {states or 'no answer'}")

"""Generated jobs on a real Slurm (slurmctld + two slurmd on this machine, fake GPU devices): sbatch, wait, read.

No GPU training is possible here: the launch step runs ``verl-safe-launch run --dry-run`` (pre-flight, run
directory, verl's validation, attach plan) against the job's real Ray cluster.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import DATA, CliResult, short_temp_dir
from slurm_cluster import Job, SlurmCluster, missing_requirement, start_cluster

# The module's Slurm cluster starts once: under pytest-xdist the whole module runs on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm-real")]

SMALL = str(DATA / "slurm" / "grpo_small.yaml")
VENV_BIN = str(Path(sys.executable).parent)
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd for nodes n1 and n2 (2 fake GPUs each), stopped by PID afterwards."""
    why = missing_requirement()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ray_root() -> Iterator[Path]:
    """A short directory for the jobs' Ray temp dirs (Ray's socket paths must stay under 107 bytes)."""
    with short_temp_dir("vr") as root:
        yield root


def write_job(cli: Callable[..., CliResult], where: Path, nodes: int, *extra: str) -> Path:
    script = where / f"job{nodes}.sbatch"
    result = cli(
        "slurm", "--nodes", str(nodes), "--gpus-per-node", "2", "--run-arg=--dry-run",
        "--setup", f"export PATH={VENV_BIN}:$PATH", "--join-timeout", "400",
        "-c", SMALL, *extra, "-o", str(script),
    )  # fmt: skip
    assert result.code == 0, result.out + result.err
    return script


def submit(
    slurm: SlurmCluster, script: Path, ray_root: Path, *options: str, env: dict[str, str] | None = None
) -> Job:
    given = {"VSL_RAY_TMP_ROOT": str(ray_root), "TMPDIR": str(ray_root), **(env or {})}
    job_id = slurm.sbatch(script, *options, cwd=script.parent, env=given)
    return slurm.wait(job_id, script.parent / f"{script.stem}-{job_id}.out", JOB_TIMEOUT_S)


def ray_processes(ray_root: Path) -> list[str]:
    """Command lines of live processes that use this module's Ray temp dirs."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(ray_root) in cmdline:
            found.append(cmdline)
    return found


def test_one_node_two_gpus(
    slurm: SlurmCluster, ray_root: Path, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    script = write_job(cli, tmp_path, 1)
    job = submit(slurm, script, ray_root)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.log
    for line in (
        "allocation seen by the pre-flight (Slurm job {id} on n1):",
        "  trainer.n_gpus_per_node = 2  matches Slurm allocation, SLURM_GPUS_ON_NODE=2",
        "  trainer.nnodes          = 1  matches Slurm allocation, SLURM_JOB_NUM_NODES=1",
        "vsl: Ray head on n1: --num-cpus=16 --num-gpus=2 (SLURM_CPUS_ON_NODE=16 SLURM_GPUS_ON_NODE=2 "
        "CUDA_VISIBLE_DEVICES=0,1)",
        "Ray cluster ready: 1/1 nodes joined: n1 (2 GPU, 16 CPU)",
        f"vsl: launch on n1: verl-safe-launch run -c {tmp_path}/job1.yaml",
        "vsl: job {id}-0 finished with exit code 0",
    ):
        assert line.format(id=job.job_id) in job.log.splitlines(), job.log
    assert job.log.index("allocation seen by the pre-flight") < job.log.index("vsl: Ray head on n1")
    assert "(RAY_ADDRESS), RAY_AUTH_MODE=token" in job.log
    assert (tmp_path / "job1-logs" / f"{job.job_id}-0" / "run" / "config.yaml").is_file()
    assert ray_processes(ray_root) == []


def test_fewer_gpus_than_the_config_fails_before_ray(
    slurm: SlurmCluster, ray_root: Path, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    script = write_job(cli, tmp_path, 1)
    job = submit(slurm, script, ray_root, "--gpus-per-node=1")
    assert (job.state, job.exit_code) == ("FAILED", 1), job.log
    for line in (
        "  trainer.n_gpus_per_node = 2  does NOT match Slurm allocation, SLURM_GPUS_ON_NODE=1",
        "error [hardware-mismatch] trainer.n_gpus_per_node=2 asks for more GPUs per node than the hardware has (1)",
        "vsl: error: the pre-flight refused this config for this allocation; Ray was not started",
    ):
        assert line in job.log.splitlines(), job.log
    assert "vsl: Ray head" not in job.log
    assert not list((tmp_path / "job1-logs" / f"{job.job_id}-0").glob("ray-*.log"))


def test_two_nodes_join_one_cluster(
    slurm: SlurmCluster, ray_root: Path, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    script = write_job(cli, tmp_path, 2)
    job = submit(slurm, script, ray_root)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.log
    lines = job.log.splitlines()
    assert f"vsl: job {job.job_id}-0 (job id-restart count): 2 node(s) n1 n2, head n1" in lines
    assert "  trainer.nnodes          = 2  matches Slurm allocation, SLURM_JOB_NUM_NODES=2" in lines
    assert "Ray cluster ready: 2/2 nodes joined: n1 (2 GPU, 16 CPU), n2 (2 GPU, 16 CPU)" in lines
    worker_log = (tmp_path / "job2-logs" / f"{job.job_id}-0" / "ray-worker-n2.log").read_text()
    assert worker_log.startswith("vsl: Ray worker on n2: --num-cpus=16 --num-gpus=2")
    assert ray_processes(ray_root) == []


def test_sbatch_reads_quoted_values_exactly(
    slurm: SlurmCluster, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    name = "x $(touch PWNED) `touch PWNED`; 'q' \"d\""
    script = write_job(cli, tmp_path, 1, "--job-name", name)
    job_id = slurm.sbatch(script, "--hold", cwd=tmp_path)
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%j"], capture_output=True, text=True, env=slurm.env
        )
        assert done.stdout.rstrip("\n") == name
    finally:
        subprocess.run(["scancel", job_id], env=slurm.env, check=False)
    assert not list(tmp_path.glob("PWNED"))


SETUP = """
PROJECT={project}
ENV_FILE=$PROJECT/env.sh
cd "$PROJECT"
eval "$(echo export VSL_EVAL_SEEN=yes)"
source "$ENV_FILE"
python3 prepare_data.py
export WANDB_API_KEY=not-a-real-key-0451
"""
# Sourced by every step of the migrated job on its node: it records the node, the directory and what eval set.
ENV_SH = 'echo "$SLURMD_NODENAME $PWD ${{VSL_EVAL_SEEN:-unset}}" >> "{project}/setup-ran"\n'


def test_migrated_two_node_job_runs_preflight_and_ray(
    slurm: SlurmCluster, ray_root: Path, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """verl's Ray-on-Slurm sample (nodes_array bug, fixed sleeps, trainer.nnodes=4 on 2 nodes), with set-up lines
    before it (cd, eval, source of a file named by a variable, a data step, a secret) → migrate → a job whose every
    step runs the set-up on its node; the data step and the secret are named, not carried over."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "env.sh").write_text(ENV_SH.format(project=project))
    header, _, body = (DATA / "sbatch" / "two_nodes_small.sbatch").read_text().partition("\nnodes=")
    original = tmp_path / "two_nodes_setup.sbatch"
    original.write_text(header + SETUP.format(project=project) + "\nnodes=" + body)
    assert cli("audit", str(original)).code == 1
    migrated = cli("migrate", str(original), "-o", f"{tmp_path}/")
    assert migrated.code == 0, migrated.err
    numbers = {line: n for n, line in enumerate(original.read_text().splitlines(), 1)}
    data_step, secret = (
        numbers["python3 prepare_data.py"],
        numbers["export WANDB_API_KEY=not-a-real-key-0451"],
    )
    assert f"not carried over: python3 prepare_data.py (line {data_step}): a step of its own" in migrated.err
    assert (
        f"export WANDB_API_KEY (line {secret}) is not carried over: it sets a secret, which never goes into a job"
        in migrated.err
    )
    assert "not-a-real-key-0451" not in migrated.out + migrated.err
    words = shlex.split(migrated.out)
    assert words[:6] == ["verl-safe-launch", "slurm", "--nodes", "2", "--gpus-per-node", "2"]
    setup = [words[i + 1] for i, w in enumerate(words) if w == "--setup"]
    assert setup == [
        f"PROJECT={project}",
        "ENV_FILE=$PROJECT/env.sh",
        'cd "$PROJECT"',
        'eval "$(echo export VSL_EVAL_SEEN=yes)"',
        'source "$ENV_FILE"',
    ]
    at = words.index("-o")
    here = ["--run-arg=--dry-run", "--setup", f"export PATH={VENV_BIN}:$PATH", "--join-timeout", "400"]
    written = cli(*words[1:at], *here, *words[at:])
    assert written.code == 0, written.out + written.err
    assert "not-a-real-key" not in Path(words[at + 1]).read_text()
    # The secret is exported where sbatch runs, as migrate's note says: sbatch hands it on to the job.
    job = submit(slurm, Path(words[at + 1]), ray_root, env={"WANDB_API_KEY": "not-a-real-key-0451"})
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.log
    assert "not-a-real-key" not in job.log
    lines = job.log.splitlines()
    assert "  trainer.nnodes          = 2  matches Slurm allocation, SLURM_JOB_NUM_NODES=2" in lines
    assert "Ray cluster ready: 2/2 nodes joined: n1 (2 GPU, 16 CPU), n2 (2 GPU, 16 CPU)" in lines
    assert job.log.index("allocation seen by the pre-flight") < job.log.index("vsl: Ray head on n1")
    seen = set((project / "setup-ran").read_text().splitlines())
    assert {f"n1 {project} yes", f"n2 {project} yes"} <= seen and all(
        line.endswith(f"{project} yes") for line in seen
    )
    assert ray_processes(ray_root) == []

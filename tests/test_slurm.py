"""The sbatch renderer: golden 4 × 8 script, bash -n, shellcheck, a run with fake srun/scontrol/ray, shell safety."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import DATA, CliResult, check_golden, short_temp_dir

from verl_safe_launch.backends import Container, SlurmSpec, render_sbatch, sbatch_options
from verl_safe_launch.errors import UsageError

SPEC_4X8 = SlurmSpec(
    nodes=4,
    gpus_per_node=8,
    config="grpo.yaml",
    log_root="grpo-logs",
    job_name="grpo",
    cpus_per_task=34,
    time="24:00:00",
    partition="gpu",
    account="rl-team",
    output="grpo-%j.out",
    setup=("module load cuda/12.4", "source ~/venvs/verl/bin/activate"),
)
SMALL = DATA / "slurm" / "grpo_small.yaml"


def bash_n(text: str, tmp_path: Path) -> None:
    script = tmp_path / "check.sbatch"
    script.write_text(text)
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_golden_4x8(tmp_path: Path) -> None:
    text = render_sbatch(SPEC_4X8)
    check_golden("slurm_4x8.sbatch", text)
    bash_n(text, tmp_path)


def test_sbatch_flags_sorted_and_quoted() -> None:
    spec = replace(SPEC_4X8, job_name="my job", partition=None, account=None)
    lines = [line for line in render_sbatch(spec).splitlines() if line.startswith("#SBATCH")]
    assert lines == sorted(lines)
    assert "#SBATCH --job-name='my job'" in lines
    assert not any("--partition" in line or "--account" in line for line in lines)
    assert [flag for flag, _ in sbatch_options(spec)] == sorted(flag for flag, _ in sbatch_options(spec))


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        (None, ["VSL_SRUN_CONTAINER=()", "VSL_WRAP=()"]),
        (
            Container("/images/verl 0.9.sif"),
            [
                "VSL_SRUN_CONTAINER=()",
                "VSL_WRAP=(apptainer exec --nv --bind . --bind grpo-logs '/images/verl 0.9.sif')",
            ],
        ),
        (
            Container("nvcr.io#verl:0.9", "pyxis"),
            [
                "VSL_SRUN_CONTAINER=('--container-image=nvcr.io#verl:0.9' "
                "'--container-mounts=.:.,grpo-logs:grpo-logs')",
                "VSL_WRAP=()",
            ],
        ),
    ],
)
def test_container(container: Container | None, expected: list[str], tmp_path: Path) -> None:
    text = render_sbatch(replace(SPEC_4X8, container=container))
    for line in expected:
        assert line in text.splitlines()
    bash_n(text, tmp_path)


def shellcheck(text: str, path: Path) -> None:
    """shellcheck (Debian's package) finds nothing in ``text``; skipped without it, except in CI."""
    if shutil.which("shellcheck") is None:
        why = "shellcheck is not installed (Debian: apt-get install shellcheck)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    path.write_text(text)
    # SC2016 ("expressions don't expand in single quotes") is the point of quoting a user's value: a setup line
    # such as 'source $HOME/venv/bin/activate' must expand on the node, when the step runs, not here.
    done = subprocess.run(
        ["shellcheck", "-s", "bash", "-e", "SC2016", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def node_script(text: str) -> str:
    """The script every step runs on its node: the quoted here-document the job hands to ``bash -c``."""
    start = text.index("<<'VSL_NODE_END' || true\n") + len("<<'VSL_NODE_END' || true\n")
    return "#!/bin/bash\n" + text[start : text.index("\nVSL_NODE_END\n", start)] + "\n"


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"container": Container("/images/verl 0.9.sif")},
        {"container": Container("nvcr.io#verl:0.9", "pyxis"), "setup": ()},
        {"overrides": ("model_engine=megatron", "~trainer.logger"), "run_args": ("--dry-run",)},
        {"job_name": "it's $(x)", "setup": ("echo \"$HOME\" 'q'",), "cpus_per_task": None},
    ],
)
def test_shellcheck_finds_nothing(change: dict[str, object], tmp_path: Path) -> None:
    text = render_sbatch(replace(SPEC_4X8, **change))  # type: ignore[arg-type]
    shellcheck(text, tmp_path / "job.sbatch")
    shellcheck(node_script(text), tmp_path / "node.sh")


def test_template_is_the_packaged_file() -> None:
    from importlib import resources

    template = (resources.files("verl_safe_launch.backends") / "templates" / "job.sh").read_text()
    body = template.split("# vsl-template: variables\n", 1)[1]
    assert render_sbatch(SPEC_4X8).endswith(body)
    assert "# vsl-template:" not in render_sbatch(SPEC_4X8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"job_name": "a\nb"}, "--job-name 'a\\nb' contains '\\n', which an '#SBATCH' line cannot carry"),
        (
            {"partition": "gpu\\x"},
            "--partition 'gpu\\\\x' contains '\\\\', which an '#SBATCH' line cannot carry",
        ),
        ({"time": " "}, "--time ' ' is empty, which an '#SBATCH' line cannot carry"),
        ({"nodes": 0}, "--nodes 0 --gpus-per-node 8: both must be at least 1"),
        ({"container": Container("x.sif", "docker")}, "unknown container runtime 'docker'"),
    ],
)
def test_refuses_what_a_script_cannot_say(change: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError) as info:
        render_sbatch(replace(SPEC_4X8, **change))  # type: ignore[arg-type]
    assert info.value.what == message


# --- a run of the 4-node script with fake Slurm and Ray commands on PATH ------------------------------------

FAKES = {
    "scontrol": r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_CALLS"
[ "$1 $2" = "show hostnames" ] && printf '%s\n' $FAKE_HOSTS
""",
    "srun": r"""#!/bin/bash
opts=()
while [[ $1 == -* ]]; do opts+=("$1"); [[ $1 == --nodelist=* ]] && host=${1#--nodelist=}; shift; done
rest=("$@")
while [ "$#" -gt 0 ] && [ "$1" != vsl-node ]; do shift; done
shift
echo "srun ${opts[*]} :: $*" >> "$FAKE_CALLS"
SLURMD_NODENAME=$host exec "${rest[@]}"
""",
    "apptainer": r"""#!/bin/bash
args=()
while [ "$1" != bash ]; do args+=("$1"); shift; done
printf 'apptainer%s\n' "$(printf ' [%s]' "${args[@]}")" >> "$FAKE_CALLS"
exec "$@"
""",
    "ray": r"""#!/bin/bash
echo "ray $SLURMD_NODENAME $*" >> "$FAKE_CALLS"
for arg in "$@"; do [[ $arg == --temp-dir=* ]] && tmp=${arg#--temp-dir=}; done
if [ "$SLURMD_NODENAME" = "${FAKE_RAY_FAIL_ON:-}" ]; then echo "fake ray: cannot start on $SLURMD_NODENAME"; exit 7; fi
mkdir -p "$tmp" && echo 10.0.0.1:6379 > "$tmp/ray_current_cluster"
trap 'echo "ray-stopped $SLURMD_NODENAME" >> "$FAKE_CALLS"; exit 0' TERM
while :; do sleep 0.2; done
""",
    "module": r"""#!/bin/bash
echo "module $* on $SLURMD_NODENAME" >> "$FAKE_CALLS"
""",
    "verl-safe-launch": r"""#!/bin/bash
printf 'vsl%s\n' "$(printf ' [%s]' "$@")" >> "$FAKE_CALLS"
if [ "$1 $2" = "slurm wait-ray" ] && [ -n "${FAKE_WAIT_FOREVER:-}" ]; then while :; do sleep 0.2; done; fi
[ "$1 $2" = "slurm preflight" ] && exit "${FAKE_PREFLIGHT_EXIT:-0}"
exit 0
""",
}


def run_with_fakes(
    script: Path, tmp_path: Path, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run a rendered script as node1 of a 4-node job, with fake Slurm/Ray/verl-safe-launch commands."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    activate = tmp_path / "venvs" / "verl" / "bin" / "activate"
    activate.parent.mkdir(parents=True, exist_ok=True)
    activate.write_text('echo "activate on $SLURMD_NODENAME" >> "$FAKE_CALLS"\n')
    job_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_CALLS": str(calls),
        "FAKE_HOSTS": "node1 node2 node3 node4",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-4]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURMD_NODENAME": "node1",
        "SLURM_CPUS_ON_NODE": "34",
        "SLURM_GPUS_ON_NODE": "8",
        **env,
    }
    with short_temp_dir("vsr") as root:  # the job refuses a Ray temp root too long for Ray's socket paths
        job_env.setdefault("VSL_RAY_TMP_ROOT", str(root))
        done = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env=job_env, timeout=120
        )
        return done, [line.replace(str(root), "RAYROOT") for line in calls.read_text().splitlines()]


def write_script(spec: SlurmSpec, tmp_path: Path) -> Path:
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    return script


def test_four_nodes_with_fake_slurm(tmp_path: Path) -> None:
    spec = replace(SPEC_4X8, run_args=("--dry-run",), overrides=("model_engine=megatron",))
    done, calls = run_with_fakes(write_script(spec, tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr
    step = "srun --nodes=1 --ntasks=1 --overlap --nodelist={} ::"
    ray = (
        "--num-cpus=34 --num-gpus=8 --dashboard-agent-listen-port=0 --disable-usage-stats --log-style=record"
    )
    tmp = "RAYROOT/vsl-ray-42-0"
    preflight = f"{step.format('node1')} verl-safe-launch slurm preflight -c grpo.yaml model_engine=megatron"
    head = f"ray node1 start --block --node-name=node1 --temp-dir={tmp}-0 {ray} --head --port=0 "
    client_port = "--ray-client-server-port=P"
    wait = f"{step.format('node1')} verl-safe-launch slurm wait-ray --address=10.0.0.1:6379 --timeout=T"
    run = (
        f"{step.format('node1')} verl-safe-launch run -c grpo.yaml --run-dir=grpo-logs/42-0/run --dry-run "
        "model_engine=megatron"
    )
    workers = [  # each node's Ray temp dir is named by its index: a long host name cannot overflow a socket path
        line
        for index, host in enumerate(("node2", "node3", "node4"), 1)
        for line in (
            f"{step.format(host)} ray-worker {host} {tmp}-{index} --address=10.0.0.1:6379",
            f"ray {host} start --block --node-name={host} --temp-dir={tmp}-{index} {ray} --address=10.0.0.1:6379",
        )
    ]
    expected = [
        "scontrol show hostnames node[1-4]",
        preflight,
        "vsl [slurm] [preflight] [-c] [grpo.yaml] [model_engine=megatron]",
        f"{step.format('node1')} ray-head node1 {tmp}-0 --head --port=0 --include-dashboard=false",
        f"{head}--include-dashboard=false {client_port}",
        *workers,
        wait + " node1 node2 node3 node4",
        "vsl [slurm] [wait-ray] [--address=10.0.0.1:6379] [--timeout=T] [node1] [node2] [node3] [node4]",
        run,
        "vsl [run] [-c] [grpo.yaml] [--run-dir=grpo-logs/42-0/run] [--dry-run] [model_engine=megatron]",
    ]
    started = [
        re.sub(
            r"--ray-client-server-port=2\d{4}",
            "--ray-client-server-port=P",
            re.sub(r"--timeout=\d+", "--timeout=T", c),
        )
        for c in calls
        if c.startswith(("scontrol", "srun", "vsl", "ray "))
    ]
    assert sorted(started) == sorted(expected)
    order = [started.index(line) for line in (preflight, f"{head}--include-dashboard=false {client_port}")]
    assert (
        order[0]
        < order[1]
        < min(started.index(line) for line in [*workers, wait + " node1 node2 node3 node4"])
    )
    assert started.index(run) == len(started) - 2
    setup = [c for c in calls if c.startswith(("module", "activate"))]
    assert len(setup) == 2 * 7 and {c.split(" on ")[1] for c in setup} == {"node1", "node2", "node3", "node4"}
    assert sorted(c for c in calls if c.startswith("ray-stopped")) == [
        f"ray-stopped node{i}" for i in range(1, 5)
    ]
    assert "vsl: Ray head up on node1 at 10.0.0.1:6379" in done.stdout
    assert (tmp_path / "grpo-logs" / "42-0" / "ray-worker-node3.log").is_file()


@pytest.mark.parametrize(
    ("env", "code", "message", "not_called"),
    [
        (
            {"FAKE_RAY_FAIL_ON": "node3", "FAKE_WAIT_FOREVER": "1"},
            3,
            "vsl: error: the Ray step on node3 exited; the end of grpo-logs/42-0/ray-worker-node3.log:\n"
            "vsl: Ray worker on node3: --num-cpus=34 --num-gpus=8",
            "[run]",
        ),
        (
            {"FAKE_RAY_FAIL_ON": "node1"},
            3,
            "vsl: error: the Ray step on node1 exited; the end of grpo-logs/42-0/ray-head-node1.log:",
            "ray-worker",
        ),
        (
            {"FAKE_PREFLIGHT_EXIT": "1"},
            1,
            "vsl: error: the pre-flight refused this config for this allocation; Ray was not started",
            "ray ",
        ),
    ],
)
def test_fails_fast(tmp_path: Path, env: dict[str, str], code: int, message: str, not_called: str) -> None:
    done, calls = run_with_fakes(write_script(SPEC_4X8, tmp_path), tmp_path, **env)
    assert done.returncode == code
    assert message in done.stderr
    assert not any(not_called in line for line in calls)
    assert f"vsl: job 42-0 finished with exit code {code}" in done.stdout


def test_a_ray_temp_root_too_long_for_a_socket_path_is_refused_before_any_step(tmp_path: Path) -> None:
    """Ray's plasma socket lives 64 bytes below a node's temp dir (4 nodes: ROOT/vsl-ray-42-0-3), and a Unix
    socket path ends at 107 bytes: a root of 28 bytes is the longest that works."""
    allowed = (
        107 - len("/vsl-ray-42-0-3") - len("/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store")
    )
    with short_temp_dir("vsr") as base:
        fits = base / ("d" * (allowed - len(str(base)) - 1))
        assert len(str(fits)) == allowed
        done, calls = run_with_fakes(write_script(SPEC_4X8, tmp_path), tmp_path, VSL_RAY_TMP_ROOT=str(fits))
        assert done.returncode == 0, done.stderr
        done, calls = run_with_fakes(write_script(SPEC_4X8, tmp_path), tmp_path, VSL_RAY_TMP_ROOT=f"{fits}d")
    assert done.returncode == 3
    assert "its socket paths would take 108 bytes, more than the 107" in done.stderr
    assert f"export VSL_RAY_TMP_ROOT=<a directory of at most {allowed} bytes>" in done.stderr
    assert [c for c in calls if not c.startswith("scontrol")] == []


# --- the command: pre-flight at render time, files, safety ------------------------------------------------

NASTY = 'a $(touch PWNED_1) `touch PWNED_2`; touch PWNED_3 "dq" it\'s $HOME\nsecond line'


def hydra_quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def test_hostile_values_are_never_executed(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    where = tmp_path / "dir $(touch PWNED_4) `touch PWNED_5`; 'q' \"d\""
    where.mkdir()
    result = cli(
        "slurm",
        "--nodes", "4", "--gpus-per-node", "8",
        "--job-name", "x$(touch PWNED_6);`touch PWNED_7` 'q' \"d\"",
        "--partition", "p $(touch PWNED_8)",
        "--account", "a'b;touch PWNED_9",
        "--container", "/img/$(touch PWNED_10) `x`.sif",
        "--run-arg=--run-dir=$(touch PWNED_11)",
        "-c", str(SMALL),
        "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        f"trainer.project_name={hydra_quoted(NASTY)}",
        "-o", str(where / "job.sbatch"),
    )  # fmt: skip
    assert result.code == 0, result.out + result.err
    values = yaml.safe_load((where / "job.yaml").read_text())
    assert values["trainer.project_name"] == NASTY
    done, calls = run_with_fakes(where / "job.sbatch", tmp_path)
    assert done.returncode == 0, done.stderr
    assert [*tmp_path.rglob("PWNED_*"), *Path.cwd().glob("PWNED_*")] == []
    assert f"apptainer [exec] [--nv] [--bind] [{where}] [/img/$(touch PWNED_10) `x`.sif]" in calls
    assert (
        f"vsl [run] [-c] [{where}/job.yaml] [--run-dir={where}/job-logs/42-0/run] [--run-dir=$(touch PWNED_11)]"
        in calls
    )
    text = (where / "job.sbatch").read_text()
    assert "#SBATCH --job-name='x$(touch PWNED_6);`touch PWNED_7` '\"'\"'q'\"'\"' \"d\"'" in text
    assert "trainer.project_name" not in text

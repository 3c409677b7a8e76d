"""``slurm``: pre-flight for the allocation at render time, the files it writes, --submit, in-job steps."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import DATA, EXAMPLES, CliResult

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest

SMALL = str(DATA / "slurm" / "grpo_small.yaml")
ALLOCATION = ("--nodes", "1", "--gpus-per-node", "2")
SLURM_ENV = {
    "SLURM_JOB_ID": "9",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_GPUS_ON_NODE": "2",
}


def test_refuses_a_config_that_cannot_run_there(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    result = cli(
        "slurm", *ALLOCATION, "-c", str(EXAMPLES / "grpo_6gpu.yaml"), "-o", str(tmp_path / "job.sbatch")
    )
    assert result.code == 1
    assert (
        "error [hardware-mismatch] trainer.n_gpus_per_node=6 asks for more GPUs per node than the hardware"
        in (result.out)
    )
    assert (
        "hardware.gpus_per_node  = 2      from hardware: declared on the command line, argument 4 (--gpus-per-node 2)"
        in result.out
    )
    assert result.out.rstrip().endswith("Nothing was written: the config cannot run on this allocation.")
    assert list(tmp_path.iterdir()) == []


def test_writes_the_script_and_the_user_layer(
    tmp_path: Path, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**SLURM_ENV, "SLURM_GPUS_ON_NODE": "1"}.items():
        monkeypatch.setenv(name, value)  # the machine rendering the job is not where it runs: ignored
    script = tmp_path / "job.sbatch"
    result = cli(
        "slurm", *ALLOCATION, "-c", SMALL, "data.max_prompt_length=512", "~trainer.logger",
        "model_engine=dp", "--partition", "gpu", "-o", str(script),
    )  # fmt: skip
    assert result.code == 0, result.out + result.err
    assert result.out.splitlines()[-3:] == [
        f"wrote {script} (1 node(s) × 2 GPUs, --cpus-per-task=16)",
        f"wrote {tmp_path / 'job.yaml'} (15 values: the config the job runs)",
        f"submit with: sbatch {script}",
    ]
    values = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert values["data.max_prompt_length"] == 512
    assert (values["trainer.n_gpus_per_node"], values["trainer.nnodes"]) == (2, 1)
    assert "trainer.logger" not in values
    text = script.read_text()
    assert "VSL_OVERRIDES=('~trainer.logger' model_engine=dp)" in text
    assert f"VSL_CONFIG={tmp_path}/job.yaml" in text and "#SBATCH --partition=gpu" in text
    assert f"#SBATCH --output={tmp_path}/job-%j.out" in text
    assert script.stat().st_mode & 0o111
    again = compose(ComposeRequest(config_files=(tmp_path / "job.yaml",))).view
    assert {key: again.get(key) for key in values} == values


def test_never_overwrites_without_force(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    (tmp_path / "job.yaml").write_text("mine: 1\n")
    result = cli("slurm", *ALLOCATION, "-c", SMALL, "-o", str(tmp_path / "job.sbatch"))
    assert result.code == 2
    assert result.err == (
        f"error: {tmp_path / 'job.yaml'} already exists\n"
        "  where: command line (-o)\n"
        "  fix: pass --force to overwrite it, or choose another path\n"
    )
    assert (tmp_path / "job.yaml").read_text() == "mine: 1\n"
    assert not (tmp_path / "job.sbatch").exists()
    assert cli("slurm", *ALLOCATION, "-c", SMALL, "-o", str(tmp_path / "job.sbatch"), "--force").code == 0
    assert (tmp_path / "job.yaml").read_text() != "mine: 1\n"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ("--cpus-per-task", "4"),
            1,
            "error [slurm-ray-cpus] --cpus-per-task 4 gives Ray 4 CPUs per node, but this run reserves 16 (GPU "
            "bundles 6 + TransferQueue 9 + scheduling 1) Ray CPUs, 6 of them on every node; verl would wait "
            "forever for them\n"
            "  --cpus-per-task = 4      from command line (--cpus-per-task 4)\n"
            "  fix: --cpus-per-task 16 (or leave it out: that is the default)",
        ),
        (
            ("hardware.nodes=2",),
            2,
            "error: 'hardware.nodes=2': the allocation is given with --nodes and --gpus-per-node\n"
            "  where: command line\n"
            "  fix: drop it and pass --nodes / --gpus-per-node",
        ),
        (
            ("--job-name", "a\nb"),
            2,
            "error: --job-name 'a\\nb' contains '\\n', which an '#SBATCH' line cannot carry\n"
            "  where: command line (--job-name)\n"
            "  fix: pass --job-name without line breaks or backslashes",
        ),
    ],
)
def test_refusals(
    tmp_path: Path, cli: Callable[..., CliResult], args: tuple[str, ...], code: int, message: str
) -> None:
    result = cli("slurm", *ALLOCATION, "-c", SMALL, *args, "-o", str(tmp_path / "job.sbatch"))
    assert result.code == code
    assert message in result.out + result.err
    assert list(tmp_path.iterdir()) == []


def test_script_must_not_be_the_yaml(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    result = cli("slurm", *ALLOCATION, "-c", SMALL, "-o", str(tmp_path / "job.yaml"))
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        "error: -o job.yaml: the script would overwrite the YAML it runs",
    )


def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$*" > {tmp_path}/sbatch-args\n{body}\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_submit(tmp_path: Path, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sbatch(tmp_path, monkeypatch, "echo '4242;cluster'")
    out = tmp_path / "out"
    out.mkdir()
    result = cli(
        "slurm", *ALLOCATION, "-c", SMALL, "-o", str(out / "job.sbatch"), "--submit", "--format", "json"
    )
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert (data["status"], data["job_id"], data["script"]) == ("written", "4242", str(out / "job.sbatch"))
    assert (tmp_path / "sbatch-args").read_text() == f"--parsable {out / 'job.sbatch'}\n"


def test_submit_refused(
    tmp_path: Path, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_sbatch(tmp_path, monkeypatch, "echo 'sbatch: error: invalid partition specified: gpu' >&2; exit 1")
    result = cli("slurm", *ALLOCATION, "-c", SMALL, "-o", str(tmp_path / "job.sbatch"), "--submit")
    assert result.code == 3
    assert result.err.splitlines()[0] == (
        "error: sbatch refused the job: sbatch: error: invalid partition specified: gpu"
    )
    assert (tmp_path / "job.sbatch").is_file()


@pytest.mark.parametrize(("gpus", "code"), [("2", 0), ("1", 1)])
def test_preflight_inside_the_allocation(
    tmp_path: Path, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch, gpus: str, code: int
) -> None:
    assert cli("slurm", *ALLOCATION, "-c", SMALL, "-o", str(tmp_path / "job.sbatch")).code == 0
    for name, value in {**SLURM_ENV, "SLURM_GPUS_ON_NODE": gpus}.items():
        monkeypatch.setenv(name, value)
    result = cli("slurm", "preflight", "-c", str(tmp_path / "job.yaml"))
    assert result.code == code
    verdict = "matches" if code == 0 else "does NOT match"
    assert result.out.splitlines()[:3] == [
        "allocation seen by the pre-flight (Slurm job 9 on n1):",
        f"  trainer.n_gpus_per_node = 2  {verdict} Slurm allocation, SLURM_GPUS_ON_NODE={gpus}",
        "  trainer.nnodes          = 1  matches Slurm allocation, SLURM_JOB_NUM_NODES=1",
    ]


ONE_NODE_SCRIPT = """#!/bin/bash
python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_batch_size=64 \\
  actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct actor_rollout_ref.rollout.name=vllm \\
  actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.n=4 \\
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 trainer.nnodes=1 trainer.n_gpus_per_node=8
"""


@pytest.mark.parametrize(
    ("verb", "extra"),
    [("slurm", ("-o", "job.sbatch")), ("kuberay", ("--image", "verl:latest", "-o", "job.yaml"))],
)
def test_a_migrated_one_node_config_is_refused_for_a_two_node_job(
    tmp_path: Path, cli: Callable[..., CliResult], verb: str, extra: tuple[str, ...]
) -> None:
    """The job asks for 2 nodes; trainer.nnodes=1 from the migrated YAML would leave one idle: an error with the
    fix, not a warning and exit 0. With the fix pasted the job is written for both nodes."""
    script = tmp_path / "one.sh"
    script.write_text(ONE_NODE_SCRIPT)
    assert cli("migrate", str(script), "-o", str(tmp_path / "run.yaml")).code == 0
    base = (
        verb,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "-c",
        str(tmp_path / "run.yaml"),
        "hardware.gpu_memory_gb=80",
    )
    out = [a if a not in ("job.sbatch", "job.yaml") else str(tmp_path / a) for a in extra]
    refused = cli(*base, *out)
    assert refused.code == 1, refused.out + refused.err
    assert (
        f"error [hardware-mismatch] trainer.nnodes=1 uses fewer nodes than the {verb} job asks for (2): the job "
        "would hold 2 and leave 1 of them idle" in refused.out
    )
    assert "fix: trainer.nnodes=2; or --nodes 1" in refused.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.sh", "run.yaml"]
    fixed = cli(*base, "trainer.nnodes=2", *out)
    assert fixed.code == 0, fixed.out + fixed.err
    assert "hardware-mismatch" not in fixed.out


def test_fewer_gpus_per_node_than_the_job_holds_is_an_error(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    result = cli(
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "-c",
        SMALL,
        "trainer.n_gpus_per_node=2",
        "-o",
        str(tmp_path / "job.sbatch"),
    )
    assert result.code == 1
    assert "trainer.n_gpus_per_node=2 uses fewer GPUs per node than the slurm job asks for (4)" in result.out
    assert "fix: trainer.n_gpus_per_node=4; or --gpus-per-node 2" in result.out


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_job_gives_ray_the_cpus_the_plan_reserves(
    tmp_path: Path, cli: Callable[..., CliResult], nodes: int
) -> None:
    """--cpus-per-task holds a node's GPU bundles, and all nodes together hold what the plan reserves (the plan's
    arithmetic is checked against a real Ray and verl's entry point in test_ray_cpus.py and test_nodes.py)."""
    from verl_safe_launch.inputs import cli_tokens
    from verl_safe_launch.rules import CPUS_PER_GPU, cpu_need

    result = cli(
        "slurm",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        "2",
        "-c",
        SMALL,
        "-o",
        str(tmp_path / "job.sbatch"),
    )
    assert result.code == 0, result.out + result.err
    asked = int((tmp_path / "job.sbatch").read_text().split("--cpus-per-task=")[1].split()[0])
    tokens = cli_tokens([f"trainer.nnodes={nodes}", "trainer.n_gpus_per_node=2"])
    view = compose(ComposeRequest(config_files=(Path(SMALL),), overrides=tokens)).view
    need = cpu_need(view)
    assert asked >= CPUS_PER_GPU * 2 and asked * nodes >= need.total, (asked, need)
    if nodes == 1:
        assert f"needs {need.describe()}" in result.out


def test_a_variable_the_job_reads_where_it_runs_is_a_warning_for_the_job_and_an_error_here(
    tmp_path: Path, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``${oc.env:NAME}`` resolves in verl's process: for a job, that is on the allocation, with the environment
    sbatch hands on, so an unset variable here cannot decide the job; for ``check`` of a run here it does."""
    monkeypatch.delenv("VSL_EXAMPLE_KEY", raising=False)
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    key = "+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_API_KEY=${oc.env:VSL_EXAMPLE_KEY}"
    job = cli("slurm", *ALLOCATION, "-c", SMALL, key, "-o", str(tmp_path / "job.sbatch"))
    assert job.code == 0, job.out + job.err
    assert "warning [config-unresolved]" in job.out + job.err and "the slurm job reads it where it runs" in (
        job.out + job.err
    )
    assert "${oc.env:VSL_EXAMPLE_KEY}" in (tmp_path / "job.yaml").read_text()
    here = cli("check", "-c", SMALL, key, "hardware.gpus_per_node=2", "hardware.nodes=1")
    assert here.code == 1 and "error [config-unresolved]" in here.out + here.err

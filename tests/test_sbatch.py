"""Slurm job scripts: #SBATCH directives as hardware facts, the Ray-on-Slurm bring-up lint, and migrate to a job."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DATA, CliResult

from verl_safe_launch.backends import BRINGUP_RULES, bringup_findings
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.shell import parse_gres, parse_job_script, read_job_script

SBATCH = DATA / "sbatch"
DOCS = SBATCH / "ray_on_slurm.sbatch"


def job(*directives: str, body: str = "python3 -m verl.trainer.main_ppo trainer.nnodes=1\n") -> str:
    return "#!/bin/bash\n" + "".join(f"#SBATCH {d}\n" for d in directives) + body


@pytest.mark.parametrize(
    ("directives", "nodes", "gpus", "gpu_type"),
    [
        (("--nodes=2", "--gpus-per-node=8"), 2, 8, None),
        (("-N 2", "--gres=gpu:8"), 2, 8, None),
        (("-N2", "--gres=gpu:a100:4"), 2, 4, "a100"),
        (("--nodes 1", "--gres=gpu:h100:8(S:0-1),shard:2"), 1, 8, "h100"),
        (("--nodes=3", "--gres=gres/gpu:2"), 3, 2, None),
        (("--nodes=2", "--gpus=16"), 2, 8, None),
        (("--nodes=2", "-G h100:8"), 2, 4, "h100"),
        (("--nodes=1", "--gpus-per-node=h100:8"), 1, 8, "h100"),
        (("--nodes=1", "--ntasks-per-node=4", "--gpus-per-task=2"), 1, 8, None),
        (("--nodes=4 --gpus-per-node=8 --cpus-per-task=64  # one line, several options",), 4, 8, None),
    ],
)
def test_gpu_and_node_spellings(
    directives: tuple[str, ...], nodes: int, gpus: int, gpu_type: str | None
) -> None:
    alloc = parse_job_script(job(*directives), "job.sbatch").allocation
    assert alloc.nodes is not None and alloc.nodes.value == nodes
    assert alloc.gpus_per_node is not None and alloc.gpus_per_node.value == gpus
    assert (alloc.gpu_type.value if alloc.gpu_type else None) == gpu_type


def test_facts_cite_the_directive_line() -> None:
    alloc = parse_job_script(
        job("-J x", "-N 2", "--gres=gpu:4", "-c 32", "--mem=200G", "-t 1:00:00"), "j.sh"
    ).allocation
    assert alloc.nodes and (alloc.nodes.source.file, alloc.nodes.source.line) == ("j.sh", 3)
    assert alloc.nodes.source.describe() == "hardware, j.sh:3: #SBATCH --nodes=2"
    assert alloc.gpus_per_node and alloc.gpus_per_node.source.line == 4
    assert alloc.cpus_per_task and (alloc.cpus_per_task.value, alloc.cpus_per_task.source.line) == (32, 5)
    assert alloc.mem and alloc.mem.value == "200G"
    assert alloc.time and alloc.time.value == "1:00:00"
    assert parse_gres("mps:100") is None and parse_gres("gpu") == (None, 1)


def test_directives_after_the_first_command_are_ignored_like_sbatch() -> None:
    script = parse_job_script(
        job("--nodes=2", body="echo hi\n#SBATCH --nodes=4\n#SBATCH --gres=gpu:8\n"), "j"
    )
    assert script.allocation.nodes and script.allocation.nodes.value == 2
    assert script.allocation.gpus_per_node is None
    assert [(d.text, d.line) for d in script.ignored] == [("--nodes=4", 4), ("--gres=gpu:8", 5)]
    disabled = parse_job_script(job("--nodes=2", body="") + "##SBATCH --nodes=8\n# SBATCH --nodes=8\n", "j")
    assert disabled.allocation.nodes and disabled.allocation.nodes.value == 2


def test_the_scripts_own_sbatch_call_wins() -> None:
    text = job("--nodes=1", "--gpus-per-node=4", body="sbatch --nodes=2 -G 16 --parsable train.sh\n")
    alloc = parse_job_script(text, "submit.sh").allocation
    assert alloc.nodes and alloc.nodes.value == 2 and alloc.nodes.source.reason == "sbatch --nodes=2"
    assert alloc.gpus_per_node and alloc.gpus_per_node.value == 4  # --gpus-per-node still comes first
    assert alloc.last("--gpus") is not None and alloc.last("--gpus").line == 4  # type: ignore[union-attr]


def test_slurm_variables_resolve_from_the_allocation() -> None:
    alloc = parse_job_script(job("--nodes=2", "--gpus-per-node=8", "--cpus-per-task=64"), "j").allocation
    assert alloc.slurm_env() == {
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "64",
        "SLURM_GPUS_PER_NODE": "8",
    }
    gres = parse_job_script(job("--nodes=2", "--gres=gpu:8"), "j").allocation
    assert "SLURM_GPUS_PER_NODE" not in gres.slurm_env()  # Slurm leaves it empty under --gres


def rule_lines(findings: list[Finding], rule_id: str) -> list[tuple[str, int | None]]:
    return [(f.severity.value, f.sources[0][2].line) for f in findings if f.rule_id == rule_id]


def test_every_bringup_rule_is_a_table_entry_with_a_fix() -> None:
    ids = [rule.rule_id for rule in BRINGUP_RULES]
    assert len(ids) == len(set(ids)) and all(rule.description for rule in BRINGUP_RULES)
    found = bringup_findings(read_job_script(DOCS)) + bringup_findings(
        read_job_script(SBATCH / "mistakes.sbatch")
    )
    assert {f.rule_id for f in found} == set(ids) - {"slurm-ray-cpus"}  # that one needs the composed config
    assert all(f.fix and f.sources and f.sources[0][2].line for f in found)


def test_docs_shaped_job_bringup_findings() -> None:
    found = bringup_findings(read_job_script(DOCS))
    assert rule_lines(found, "slurm-nodes-array") == [("error", 22)]
    assert rule_lines(found, "slurm-fixed-sleep") == [("warning", 36), ("warning", 46)]
    assert rule_lines(found, "slurm-ray-resources") == [("warning", 33), ("warning", 44)]
    assert rule_lines(found, "slurm-head-address") == [("warning", 25)]
    assert rule_lines(found, "slurm-driver-overlap") == [("error", 49)]
    assert rule_lines(found, "slurm-ray-block") == []
    array = next(f for f in found if f.rule_id == "slurm-nodes-array")
    assert 'nodes_array=("$nodes")' in array.message
    assert array.fix == 'mapfile -t nodes_array < <(scontrol show hostnames "$SLURM_JOB_NODELIST")'


def test_one_node_allocation_makes_the_array_bug_a_warning() -> None:
    body = 'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")\nnodes_array=("$nodes")\n'
    body += 'srun -w "${nodes_array[0]}" ray start --head --num-cpus=8 --num-gpus=1 --block &\n'
    found = bringup_findings(parse_job_script(job("--nodes=1", "--gpus-per-node=1", body=body), "j"))
    assert rule_lines(found, "slurm-nodes-array") == [("warning", 5)]
    fixed = body.replace('("$nodes")', "($nodes)")
    assert (
        rule_lines(bringup_findings(parse_job_script(job("--nodes=2", body=fixed), "j")), "slurm-nodes-array")
        == []
    )


def test_mistakes_job_bringup_findings() -> None:
    found = bringup_findings(read_job_script(SBATCH / "mistakes.sbatch"))
    assert rule_lines(found, "slurm-directive") == [("warning", 8), ("warning", 3)]
    assert rule_lines(found, "slurm-ray-resources") == [("error", 15), ("warning", 17)]
    assert rule_lines(found, "slurm-ray-block") == [("error", 15), ("error", 17), ("error", 20)]
    assert rule_lines(found, "slurm-nodes-array") == []  # nodes_array=($nodes) splits correctly
    messages = " ".join(f.message for f in found)
    assert (
        "--num-gpus=16, but the allocation has 8 GPUs per node (#SBATCH --gpus-per-node=8, line 4)"
        in messages
    )


def test_gpus_per_node_variable_under_gres_is_empty() -> None:
    body = 'srun ray start --head --num-cpus=8 --num-gpus "${SLURM_GPUS_PER_NODE}" --block &\n'
    found = bringup_findings(parse_job_script(job("--nodes=1", "--gres=gpu:8", body=body), "j"))
    assert rule_lines(found, "slurm-ray-resources") == [("error", 4)]
    assert "Slurm leaves $SLURM_GPUS_PER_NODE empty" in found[0].message


def audit(cli: Callable[..., CliResult], name: str) -> CliResult:
    return cli("audit", str(SBATCH / name))


def test_audit_docs_job_is_no_go_naming_both_values_and_lines(cli: Callable[..., CliResult]) -> None:
    result = audit(cli, "ray_on_slurm.sbatch")
    assert result.code == 1, result.out
    path = str(DOCS)
    assert (
        "error [hardware-mismatch] trainer.nnodes=4 asks for more nodes than the hardware has (2) "
        f"(line 70 of {path}; the allocation: #SBATCH --nodes=2, line 3)"
    ) in result.out.splitlines()
    assert f"  hardware.nodes = 2      from hardware, {path}:3: #SBATCH --nodes=2" in result.out.splitlines()
    assert 'error [slurm-nodes-array] line 22: nodes_array=("$nodes") puts the whole node list' in result.out
    assert "hardware-unknown] GPUs per node" not in result.out


def test_audit_clean_jobs_are_go(cli: Callable[..., CliResult]) -> None:
    for name in ("single_node.sbatch", "apptainer_two_nodes.sbatch"):
        result = audit(cli, name)
        assert result.code == 0, result.out
        assert "[slurm-" not in result.out and "hardware-mismatch" not in result.out, result.out


def test_audit_judges_ray_cpus_against_cpus_per_task(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    text = (
        (SBATCH / "apptainer_two_nodes.sbatch").read_text().replace("--cpus-per-task=48", "--cpus-per-task=8")
    )
    script = tmp_path / "few_cpus.sbatch"
    script.write_text(text)
    result = cli("audit", str(script))
    assert result.code == 1
    line = next(x for x in result.out.splitlines() if x.startswith("error [slurm-ray-cpus]"))
    assert line.startswith("error [slurm-ray-cpus] line 6: Ray gets 8 CPUs per node from --cpus-per-task")


def test_audit_hardware_arguments_still_win(cli: Callable[..., CliResult]) -> None:
    result = cli("audit", str(DOCS), "--", "hardware.nodes=4")
    assert "trainer.nnodes=4 asks for more nodes" not in result.out


def migrate(cli: Callable[..., CliResult], name: str, out: Path) -> tuple[CliResult, list[str]]:
    result = cli("migrate", str(SBATCH / name), "-o", f"{out}/")
    assert result.code == 0, result.err
    command = result.out.strip()
    assert "\n" not in command
    return result, shlex.split(command)


def test_migrate_docs_job_prints_the_slurm_command(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    result, words = migrate(cli, "ray_on_slurm.sbatch", tmp_path)
    yaml_path = tmp_path / "ray_on_slurm.yaml"
    assert words == [
        "verl-safe-launch", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task", "64",
        "--mem", "200G", "--time", "04:00:00", "--partition", "gpu", "--job-name", "verl-ray-on-slurm",
        "--output", "slurm-%j.out", "--setup", "module load cuda/12.4",
        "--setup", "source ~/venvs/verl/bin/activate",
        "-c", str(yaml_path), "-o", str(tmp_path / "ray_on_slurm.job.sbatch"),
    ]  # fmt: skip
    text = yaml_path.read_text()
    assert "nnodes" not in text and "n_gpus_per_node" not in text
    assert "  train_batch_size: 256  # ray_on_slurm.sbatch:54" in text
    assert (
        "note: trainer.nnodes=4 (line 70) is left out: the job fills it from the allocation (2)" in result.err
    )
    assert (
        "note: not carried over: #SBATCH --constraint=h100 (line 11); add it to the new job by hand"
        in result.err
    )
    # the printed command writes a correct job for the same allocation
    written = cli(*words[1:])
    assert written.code == 0, written.out + written.err
    job_text = (tmp_path / "ray_on_slurm.job.sbatch").read_text()
    assert "#SBATCH --nodes=2\n" in job_text and "#SBATCH --gpus-per-node=8\n" in job_text
    assert "trainer.nnodes: 2" in (tmp_path / "ray_on_slurm.job.yaml").read_text()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "apptainer_two_nodes.sbatch",
            ["--container", "/scratch/images/verl-0.5.sif", "--container-runtime", "apptainer"],
        ),
        (
            "pyxis_gpus_total.sbatch",
            ["--container", "nvcr.io/nvidia/verl:25.01", "--container-runtime", "pyxis"],
        ),
    ],
)
def test_migrate_carries_the_container(
    cli: Callable[..., CliResult], tmp_path: Path, name: str, expected: list[str]
) -> None:
    _, words = migrate(cli, name, tmp_path)
    at = words.index("--container")
    assert words[at : at + 4] == expected
    assert words[2:6] == ["--nodes", "2", "--gpus-per-node", "4" if "apptainer" in name else "8"]


def test_migrate_lists_what_it_cannot_carry(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    result, words = migrate(cli, "apptainer_two_nodes.sbatch", tmp_path)
    assert "note: the GPU type 'a100' (#SBATCH --gres=gpu:a100:4, line 5) is not carried over" in result.err
    assert "note: not carried over: #SBATCH --exclusive (line 9)" in result.err
    result, words = migrate(cli, "mistakes.sbatch", tmp_path)
    assert "note: ignored by sbatch, not carried over: #SBATCH --time=08:00:00 (line 8)" in result.err
    assert "--time" not in words


def test_plain_scripts_migrate_as_before(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.train_batch_size=64\n")
    result = cli("migrate", str(script), "-o", str(tmp_path / "run.yaml"))
    assert result.out.strip() == f"verl-safe-launch -c {tmp_path / 'run.yaml'}"
    assert bringup_findings(read_job_script(script)) == []
    assert Severity.ERROR not in {
        f.severity for f in bringup_findings(read_job_script(SBATCH / "single_node.sbatch"))
    }


def test_allocation_problems_are_named() -> None:
    problems = {
        d.text: why
        for d, why in parse_job_script(
            job("--nodes=2-4", "--gpus=6", "--ntasks-per-node=8", "--nodes=3", "--gpus=7"), "j"
        ).allocation.problems
    }
    assert problems == {
        "--gpus=7": "7 GPUs do not split evenly over 3 node(s); Slurm may place them unevenly",
        "--ntasks-per-node=8": "Ray-on-Slurm runs one task per node; the CPUs per task are then a share",
    }
    ranged = parse_job_script(job("--nodes=2-4"), "j").allocation
    assert ranged.nodes and ranged.nodes.value == 2
    assert [why for _, why in ranged.problems] == ["a range; the launch is judged against the minimum, 2"]


def test_docker_containers_are_listed_not_guessed(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    text = DOCS.read_text().replace(
        "    ray start --head", '    docker exec "$CONTAINER_NAME" ray start --head'
    )
    script = tmp_path / "docker.sbatch"
    script.write_text(text)
    result = cli("migrate", str(script), "-o", f"{tmp_path}/out/")
    assert result.code == 0, result.err
    assert "--container" not in result.out
    assert "note: line 33 runs in a container with docker" in result.err
    assert (tmp_path / "out" / "docker.yaml").is_file()


def test_host_memory_is_judged_against_the_jobs_own_mem(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """``#SBATCH --mem`` is the host memory of every node: a 7B actor offloaded to the CPU does not fit in 8 GiB."""
    script = (DATA / "sbatch" / "single_node.sbatch").read_text()
    script = script.replace("#SBATCH --mem=256G", "#SBATCH --mem=8G").replace(
        "Qwen/Qwen2.5-0.5B-Instruct \\\n",
        "Qwen/Qwen2.5-7B-Instruct \\\n    actor_rollout_ref.actor.fsdp_config.param_offload=True \\\n"
        "    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \\\n",
    )
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    out = cli("audit", str(path), "--", "hardware.gpu_memory_gb=80").out
    assert "error [host-memory-out-of-memory]" in out, out
    assert "job.sbatch:6" in out  # the #SBATCH --mem line is where the limit comes from
    roomy = path.read_text().replace("#SBATCH --mem=8G", "#SBATCH --mem=2T")
    path.write_text(roomy)
    assert "host-memory-out-of-memory" not in cli("audit", str(path), "--", "hardware.gpu_memory_gb=80").out


def _run_printed(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A printed command line run by bash with the installed console script first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["VSL_HARDWARE_DETECT"] = "0"
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edits", "code"),
    [
        ({}, 0),
        ({"ppo_micro_batch_size_per_gpu=4": "ppo_micro_batch_size_per_gpu=5"}, 1),
    ],
)
def test_the_commands_migrate_prints_for_a_job_run(
    cli: Callable[..., CliResult], tmp_path: Path, edits: dict[str, str], code: int
) -> None:
    text = (SBATCH / "single_node.sbatch").read_text()
    for old, new in edits.items():
        text = text.replace(old, new)
    (tmp_path / "job.sbatch").write_text(text)
    result = cli("migrate", str(tmp_path / "job.sbatch"), "-o", str(tmp_path / "job.yaml"))
    assert result.code == 0, result.err
    if code:
        [check] = [line.split("see them with: ")[1] for line in result.err.splitlines() if "see them" in line]
        checked = _run_printed(check, tmp_path)
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert "error [" in checked.stdout
        summary = result.err.split("pre-flight of the migrated config: ")[1].split(";")[0]
        assert summary in checked.stdout, "the note's verdict is the printed check's"
    written = _run_printed(result.out.strip(), tmp_path)
    assert written.returncode == code, written.stdout + written.stderr
    assert (tmp_path / "job.job.sbatch").is_file() == (code == 0)

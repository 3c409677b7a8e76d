"""The CPUs a locally started Ray counts, judged against the V1 trainer's reservation (``check`` and the callback)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, make_tiny_model
from recompose import recompose

from hydra_plugins.verl_safe_launch.callback import ENABLE_OVERRIDE
from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs.cpus import existing_ray, ray_address_file, ray_cpu_count
from verl_safe_launch.rules import run_rules
from verl_safe_launch.rules.resources import cpu_need

MACHINE = HardwareFacts(nodes=1, gpus_per_node=8, gpu_memory_gb=80.0)


def _ray_cpus(overrides: list[str], hardware: HardwareFacts) -> list[tuple[Severity, str, str | None]]:
    view = recompose(["trainer.n_gpus_per_node=8", *overrides]).view
    found = run_rules(RuleContext(view, None, None, hardware))
    return [(f.severity, f.message, f.fix) for f in found if f.rule_id == "layout-ray-cpus"]


def _counted(cpus: int, certain: bool, joins: str | None = None) -> HardwareFacts:
    from dataclasses import replace

    return replace(
        MACHINE, cpus_per_node=cpus, cpus_from="hardware: counted", cpus_certain=certain, ray_joins=joins
    )


def test_too_few_counted_cpus_is_an_error_where_verl_starts_ray() -> None:
    [(severity, message, fix)] = _ray_cpus([], _counted(2, certain=True))
    assert severity is Severity.ERROR
    assert message == (
        "ray_kwargs.ray_init.num_cpus is null, so Ray on this machine counts 2 CPUs (hardware: counted), below "
        "the 34 logical CPUs the V1 trainer reserves (GPU bundles 24 + TransferQueue 9 + scheduling 1); the "
        "TransferQueue start-up then waits forever without an error"
    )
    assert fix == "ray_kwargs.ray_init.num_cpus=34"
    assert _ray_cpus([fix], _counted(2, certain=True)) == [], "the fix, applied and re-checked, passes"


def test_a_login_node_count_is_a_warning() -> None:
    [(severity, message, _)] = _ray_cpus([], _counted(2, certain=False))
    assert severity is Severity.WARNING and "a Ray that verl starts on this machine counts 2" in message


@pytest.mark.parametrize(
    ("overrides", "joins", "said"),
    [
        (
            [],
            "RAY_ADDRESS=10.0.0.1:6379 is set, so ray.init() joins that cluster",
            "RAY_ADDRESS=10.0.0.1:6379",
        ),
        (["+ray_kwargs.ray_init.address=10.0.0.1:6379"], None, "ray_init.address=10.0.0.1:6379 joins"),
    ],
)
def test_joining_a_running_ray_is_not_judged_by_this_machine(
    overrides: list[str], joins: str | None, said: str
) -> None:
    [(severity, message, _)] = _ray_cpus(overrides, _counted(2, certain=True, joins=joins))
    assert severity is Severity.INFO and said in message


def test_enough_cpus_pass() -> None:
    assert _ray_cpus([], _counted(34, certain=True)) == []


def test_the_count_is_rays_own() -> None:
    from ray._private.utils import get_num_cpus

    assert ray_cpu_count(os.environ)[0] == int(get_num_cpus(override_docker_cpu_warning=True))


def test_a_cgroup_quota_and_cpuset_are_read_as_ray_reads_them(tmp_path: Path) -> None:
    from ray._private.utils import _get_docker_cpus

    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpuset").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpuset" / "cpuset.cpus").write_text("0-3,8\n")
    ray = _get_docker_cpus(
        str(tmp_path / "cpu" / "cpu.cfs_quota_us"),
        str(tmp_path / "cpu" / "cpu.cfs_period_us"),
        str(tmp_path / "cpuset" / "cpuset.cpus"),
        str(tmp_path / "cpu.max"),
    )
    assert ray is not None
    assert ray_cpu_count({}, tmp_path) == (int(ray), "the container's CPU quota (cgroup cpu.cfs_quota_us)")


def test_a_running_ray_is_found_by_address(tmp_path: Path) -> None:
    assert existing_ray({"RAY_ADDRESS": "local", "TMPDIR": str(tmp_path)}) is None
    assert "joins that cluster" in (existing_ray({"RAY_ADDRESS": "h:6379"}) or "")


@pytest.mark.parametrize(
    "env",
    [{}, {"TMPDIR": "/t/a"}, {"RAY_TMPDIR": "/t/b", "TMPDIR": "/t/a"}, {"RAY_TMPDIR": ""}, {"TMPDIR": ""}],
    ids=["default", "tmpdir", "ray-tmpdir", "empty-ray-tmpdir", "empty-tmpdir"],
)
def test_the_address_file_is_where_ray_looks_for_it(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's own ``get_ray_address_file`` is the oracle: the file a plain ``ray.init()`` reads to join a cluster."""
    from ray._common.utils import get_ray_address_file

    for name in ("RAY_TMPDIR", "TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert str(ray_address_file(env)) == os.path.normpath(get_ray_address_file(None))


def test_only_a_cluster_ray_start_recorded_is_joined(tmp_path: Path) -> None:
    """Another ``ray.init()``'s Ray on the machine is not joined; the one ``ray start`` recorded is."""
    env = {"TMPDIR": str(tmp_path)}
    assert existing_ray(env) is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.1:6379\n")
    assert existing_ray(env) == (
        f"'ray start' recorded the cluster at 10.0.0.1:6379 in {tmp_path}/ray/ray_current_cluster, "
        "so ray.init() joins it"
    )


@pytest.mark.slow
def test_a_local_ray_counts_what_we_count(tmp_path: Path) -> None:
    """ray.init(num_cpus=None) on this machine, in its own temp dir and HOME; its CPU resource is our count."""
    short = Path(tempfile.mkdtemp(prefix="vsl-cpus-", dir="/tmp"))  # Ray's socket paths must stay short
    code = (
        "import json, ray\n"
        f"ray.init(num_cpus=None, include_dashboard=False, _temp_dir={str(short)!r})\n"
        "print(json.dumps(ray.cluster_resources().get('CPU')))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    shutil.rmtree(short, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ray_cpu_count(env)[0]


# verl's real entry point, stopped right after its own validate_config (before ray.init).
PROBED_MAIN = (
    "-c",
    "import runpy, sys, verl.utils.config as c\n"
    "real = c.validate_config\n"
    "def probe(config, *args, **kwargs):\n"
    "    real(config, *args, **kwargs)\n"
    "    print('VERL_VALIDATED', flush=True)\n"
    "    raise SystemExit(0)\n"
    "c.validate_config = probe\n"
    "sys.argv = ['main_ppo', *sys.argv[1:]]\n"
    "runpy.run_module('verl.trainer.main_ppo', run_name='__main__', alter_sys=True)\n",
)


@pytest.mark.slow
def test_verls_entry_point_with_the_callback_stops_before_a_ray_that_would_hang(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny-model")
    gpus = os.cpu_count() or 1  # 3 CPUs per GPU bundle: never enough, whatever this machine has
    need = cpu_need(recompose([f"trainer.n_gpus_per_node={gpus}"]).view).total
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VSL_", "SLURM_"))}
    env["HOME"] = str(tmp_path)
    base = [
        sys.executable,
        *PROBED_MAIN,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.n_gpus_per_node={gpus}",
        "data.train_batch_size=" + str(gpus * 2),
        "actor_rollout_ref.actor.ppo_mini_batch_size=" + str(gpus),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        f"+hydra.callbacks.vsl.gpus_per_node={gpus}",
        "+hydra.callbacks.vsl.gpu_memory_gb=80",
        ENABLE_OVERRIDE,
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
        )

    stopped = run()
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "error [layout-ray-cpus] ray_kwargs.ray_init.num_cpus is null, so Ray on this machine counts" in (
        stopped.stderr
    )
    block = stopped.stderr[stopped.stderr.index("error [layout-ray-cpus]") :].split("\n\n")[0]
    assert f"fix: ray_kwargs.ray_init.num_cpus={need}" in block, block
    assert "VERL_VALIDATED" not in stopped.stdout
    fixed = run(f"ray_kwargs.ray_init.num_cpus={need}")
    assert "layout-ray-cpus" not in fixed.stderr, fixed.stderr[-3000:]


@pytest.mark.parametrize(
    ("hardware", "said"),
    [
        (HardwareFacts(gpus_per_node=8), "skipped: hardware.nodes is unknown (declare hardware.nodes)"),
        (
            HardwareFacts(nodes=2),
            "skipped: hardware.gpus_per_node is unknown (declare hardware.gpus_per_node)",
        ),
        (
            HardwareFacts(),
            "skipped: hardware.nodes and hardware.gpus_per_node are unknown (declare hardware.nodes and "
            "hardware.gpus_per_node)",
        ),
    ],
)
def test_the_gpu_check_names_exactly_what_is_unknown(hardware: HardwareFacts, said: str) -> None:
    view = recompose([]).view
    found = run_rules(RuleContext(view, None, None, hardware))
    assert [f.message for f in found if f.rule_id == "layout-gpus-available"] == [said]

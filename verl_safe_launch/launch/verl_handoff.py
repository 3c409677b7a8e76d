"""Hand the validated config to verl: its own validation, Ray start or attach, resource checks, ``run_ppo``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from verl_safe_launch.errors import LaunchError, UsageError
from verl_safe_launch.inputs import verl_origin
from verl_safe_launch.launch.deadline import within
from verl_safe_launch.launch.hooks import RUN_DIR_ENV
from verl_safe_launch.launch.model_access import describe_exception
from verl_safe_launch.launch.plan import LaunchBlocked, LaunchPlan
from verl_safe_launch.launch.ray_auth import auth_env, refused
from verl_safe_launch.launch.rundir import CONFIG_FILE, config_digest, render_config
from verl_safe_launch.render import json_text
from verl_safe_launch.rules import CpuNeed, GpuNeed

RUNNER_RECORD = "task_runner.json"
ATTACH_TIMEOUT_ENV = "VSL_RAY_ATTACH_TIMEOUT"
ATTACH_TIMEOUT_S = 60.0


def import_chosen_verl() -> str | None:
    """Make the verl the checks read (``--verl``, ``VSL_VERL``) the one this process and Ray's workers import.

    Returns the directory put first on the import path (``None`` when that verl is the one Python finds anyway);
    the launch passes it to Ray's workers as ``PYTHONPATH``. A verl imported from elsewhere before is refused.
    """
    package, origin = verl_origin()
    loaded = sys.modules.get("verl")
    if loaded is not None:
        where = Path(getattr(loaded, "__file__", "") or "").parent
        if where.resolve() != package.resolve():
            raise UsageError(
                f"verl was already imported from {where}, not from {package} ({origin})",
                where=origin,
                fix="launch from a fresh process: verl-safe-launch run --verl DIR ...",
            )
        return None
    spec = importlib.util.find_spec("verl")
    if (
        spec is not None
        and spec.origin is not None
        and Path(spec.origin).parent.resolve() == package.resolve()
    ):
        return None
    directory = str(package.parent)
    sys.path.insert(0, directory)
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (directory, os.environ.get("PYTHONPATH")) if p)
    return directory


def validate_with_verl(cfg: Any) -> bool:
    """``auto_set_device`` then ``validate_config``, exactly as verl's ``main()`` calls them.

    False when the verl in use has no driver-side ``validate_config`` (releases before 0.6 validate inside the
    trainer, after Ray starts): nothing was validated here.
    """
    try:
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config
        from verl.utils.device import auto_set_device
    except ImportError as exc:
        if exc.name is not None and (exc.name == "verl" or exc.name.startswith("verl.")):
            return False
        package, origin = verl_origin()
        raise LaunchError(
            f"verl at {package} ({origin}) cannot be imported in this Python: {cause_line(exc)}",
            where=f"{origin}: {package}",
            fix="install the packages that verl release needs into this environment, or launch with the verl "
            "installed here (without --verl)",
        ) from None

    try:
        with contextlib.redirect_stdout(sys.stderr):  # verl prints progress; stdout is the report
            auto_set_device(cfg)
            validate_config(
                config=cfg,
                use_reference_policy=need_reference_policy(cfg),
                use_critic=need_critic(cfg),
            )
    except Exception as exc:
        raise LaunchBlocked(
            f"verl's validate_config rejected the config: {cause_line(exc)}",
            where="verl.utils.config.validate_config, called as verl's main() calls it",
            fix="run 'verl-safe-launch check' with the same arguments to see every problem with its fix",
        ) from None
    return True


def cause_line(exc: BaseException) -> str:
    """The root cause in one line: under Ray's task errors, the original exception's type and first line."""
    # a task error's cause may itself be a task error (a worker called by the task runner)
    for _ in range(32):
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    return describe_exception(exc)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# How Ray names the process a task error came from: "ray::WorkerDict.init_model() (pid=123, ip=10.0.0.2, ...".
_RAY_TASK = re.compile(r"ray::([\w.]+)\(\)\s*\(pid=(\d+), ip=([^,)\s]+)")


def failed_worker(exc: BaseException) -> str | None:
    """The innermost Ray task in an error's traceback (the worker that raised first): ``Class.method (pid, ip)``."""
    found = _RAY_TASK.findall(_ANSI.sub("", str(exc)))
    if not found:
        return None
    name, pid, ip = found[-1]
    return f"{name} (pid {pid}, {ip})"


def local_gpu_count() -> int:
    """CUDA devices visible to this process (0 on a machine without GPUs)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@contextlib.contextmanager
def ray_session(plan: LaunchPlan) -> Iterator[None]:
    """Start a local Ray or attach to the planned cluster, and shut down only a Ray this context started.

    When this process is already connected to Ray, that connection is used as it is.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    with auth_env(plan.auth):
        _init(plan)
        try:
            yield
        finally:
            ray.shutdown()


def _init(plan: LaunchPlan) -> None:
    import ray

    try:
        if plan.address is None:
            ray.init(**plan.init_kwargs)
        else:  # Ray retries an address that never answers without end: attach with a deadline
            within(lambda: ray.init(**plan.init_kwargs), attach_timeout(os.environ))
    except TimeoutError as exc:
        raise UsageError(
            f"no Ray cluster answered at {plan.address} ({plan.address_source}): {exc}",
            where=f"run directory {plan.run_dir}",
            fix=f"check that the cluster is up and that {plan.address_source} is its GCS address (HEAD:6379), "
            f"or unset it to start a local Ray; {ATTACH_TIMEOUT_ENV}=SECONDS waits longer",
        ) from None
    except Exception as exc:
        raise _ray_error(plan, exc) from None


def attach_timeout(env: Mapping[str, str]) -> float:
    """Seconds ``ray.init`` may take to attach to a cluster: ``VSL_RAY_ATTACH_TIMEOUT``, else 60."""
    text = env.get(ATTACH_TIMEOUT_ENV, "")
    try:
        seconds = float(text) if text else ATTACH_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 86400:
        raise UsageError(
            f"{ATTACH_TIMEOUT_ENV}={text} is not a number of seconds",
            where=ATTACH_TIMEOUT_ENV,
            fix=f"a number from 1 to 86400, e.g. {ATTACH_TIMEOUT_ENV}=120 (default {ATTACH_TIMEOUT_S:g})",
        )
    return seconds


def _ray_error(plan: LaunchPlan, exc: BaseException) -> LaunchError:
    where = f"{plan.address or 'local Ray'} ({plan.address_source}); run directory {plan.run_dir}"
    if refused(exc):
        return LaunchError(
            f"the Ray cluster at {plan.address} refused this process: it uses token authentication and this "
            f"process {'presented a token it does not accept' if plan.auth.mode == 'token' else 'has no token'} "
            f"(RAY_AUTH_MODE={plan.auth.mode}: {plan.auth.why})",
            where=where,
            fix="use the cluster's token: RAY_AUTH_TOKEN=... or RAY_AUTH_TOKEN_PATH=FILE (as on its nodes), "
            "or start the cluster with RAY_AUTH_MODE=disabled on every node",
        )
    return LaunchError(
        f"could not {'attach to' if plan.address else 'start'} Ray: {cause_line(exc)}",
        where=where,
        fix="check RAY_ADDRESS / ray_kwargs.ray_init.address, or unset both to start a local Ray",
    )


def check_gpus(need: GpuNeed, resources: Mapping[str, float], where: str) -> LaunchError | None:
    """An error naming both numbers when the cluster has fewer GPUs than the config's pools need."""
    have = int(resources.get("GPU", 0))
    if have >= need.total:
        return None
    return LaunchError(
        f"the Ray cluster has {have} GPUs; the config needs {need.describe()}",
        where=where,
        fix="attach to a cluster with enough GPUs (RAY_ADDRESS), or lower trainer.n_gpus_per_node / trainer.nnodes",
    )


def check_cpus(need: CpuNeed, resources: Mapping[str, float], where: str) -> LaunchError | None:
    """An error naming both numbers when the cluster has fewer CPUs than the run reserves (it would hang)."""
    have = int(resources.get("CPU", 0))
    if have >= need.total:
        return None
    return LaunchError(
        f"the Ray cluster has {have} CPUs; this run reserves {need.describe()} and would wait forever",
        where=where,
        fix=f"start Ray with --num-cpus={need.total} or more on the head node (logical CPUs: oversubscribing is fine)",
    )


def cluster_resources() -> dict[str, float]:
    """Total resources of the connected Ray cluster."""
    import ray

    return dict(ray.cluster_resources())  # type: ignore[no-untyped-call]


def observed_runner(task_runner: str) -> Any:
    """verl's task runner (V1 or v0) as a Ray actor that first records the config it received."""
    import ray

    module_name, _, name = task_runner.rpartition(".")
    base = getattr(importlib.import_module(module_name), name).__ray_actor_class__

    def run(self: Any, config: Any) -> Any:
        record_received_config(config, name)
        return base.run(self, config)

    cls = type(f"Observed{name}", (base,), {"run": run, "__module__": __name__})
    return ray.remote(cls)


def record_received_config(config: Any, runner: str) -> None:
    """Inside the task runner: write the digest of the config it received next to config.yaml."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    digest = config_digest(render_config(config))
    expected = Path(run_dir) / CONFIG_FILE
    on_disk = config_digest(expected.read_text()) if expected.is_file() else None
    record = {
        "task_runner": runner,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "config_sha256": digest,
        "matches_config_yaml": digest == on_disk,
    }
    with contextlib.suppress(OSError):  # the run directory may not be shared with this node
        (Path(run_dir) / RUNNER_RECORD).write_text(json_text(record))


def submit(cfg: Any, plan: LaunchPlan) -> None:
    """``run_ppo`` with verl's task runner; any failure becomes a one-line LaunchError naming the run directory."""
    from verl.trainer.main_ppo import run_ppo

    try:
        if "task_runner_class" in inspect.signature(run_ppo).parameters:
            run_ppo(cfg, task_runner_class=observed_runner(plan.task_runner))
        else:  # verl before 0.6 (--verl): its own runner, so no record of the config it received
            run_ppo(cfg)  # type: ignore[call-arg]
    except Exception as exc:
        worker = failed_worker(exc)
        raise LaunchError(
            f"the launch failed{f' in {worker}' if worker else ''}: {cause_line(exc)}",
            where=f"run directory {plan.run_dir}",
            fix="the run directory holds the config, the command and the memory records; "
            f"Ray's logs are under {ray_logs()}",
        ) from None


def ray_logs() -> str:
    """Where the connected Ray keeps its logs (its session directory), as a path when Ray says."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is not None:
            return str(Path(node.get_session_dir_path()) / "logs")
    except Exception:  # a Ray without this internal: name the local default
        pass
    return "its session directory (/tmp/ray/session_latest/logs for a local Ray)"

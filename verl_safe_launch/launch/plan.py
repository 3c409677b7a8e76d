"""The launch plan: where Ray runs, what the config needs from it and what each worker gets."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import EXIT_PREFLIGHT, VslError
from verl_safe_launch.launch.hooks import RUN_DIR_ENV, SETUP_HOOK, USER_SETUP_HOOK_ENV
from verl_safe_launch.launch.ray_auth import RayAuth, ray_auth
from verl_safe_launch.rules import CpuNeed, GpuNeed, cpu_need, gpu_need

RUNNER_V1 = "verl.trainer.main_ppo.TaskRunnerV1"
RUNNER_V0 = "verl.trainer.main_ppo_v0.TaskRunner"
RUNNER_BEFORE_09 = "verl.trainer.main_ppo.TaskRunner"


class LaunchBlocked(VslError):
    """Nothing was started: verl's own validation, or a Ray setting, rules the launch out."""

    exit_code = EXIT_PREFLIGHT


@dataclass(frozen=True)
class LaunchPlan:
    """What ``run`` starts: the Ray address (None: a new local Ray), ``ray.init`` arguments, needs, runner."""

    address: str | None
    address_source: str
    auth: RayAuth
    init_kwargs: Mapping[str, Any]
    gpus: GpuNeed
    cpus: CpuNeed
    task_runner: str
    run_dir: Path

    def to_json(self) -> dict[str, Any]:
        """Stable JSON form (the ``plan`` object of ``run --format json``)."""
        return {
            "ray_address": self.address or "local (a new Ray started by verl-safe-launch)",
            "ray_address_source": self.address_source,
            "ray_auth_mode": self.auth.mode,
            "ray_auth": self.auth.to_json(),
            "ray_init": dict(self.init_kwargs),
            "gpus_needed": {
                "total": self.gpus.total,
                "global_pool": self.gpus.global_pool,
                "reward_pool": self.gpus.reward_pool,
                "teacher_pool": self.gpus.teacher_pool,
            },
            "cpus_needed": self.cpus.total,
            "task_runner": self.task_runner,
            "run_dir": str(self.run_dir),
        }


def ray_address(view: ConfigView, env: Mapping[str, str]) -> tuple[str | None, str]:
    """The cluster to attach to and where that came from; (None, "local") to start a new local Ray."""
    configured = view.get("ray_kwargs.ray_init.address")
    if configured:
        return str(configured), "ray_kwargs.ray_init.address"
    if env.get("RAY_ADDRESS"):
        return env["RAY_ADDRESS"], "RAY_ADDRESS"
    return None, "local"


def auth_mode(address: str | None, env: Mapping[str, str]) -> str:
    """The RAY_AUTH_MODE the driver and everything it starts use (see ``ray_auth``)."""
    return ray_auth(address, env).mode


def apply_determinism_env(cfg: Any, environ: dict[str, str] | os._Environ[str]) -> None:
    """The environment lines verl's ``run_ppo`` sets before ``ray.init`` (determinism, RL insight).

    Keys a release does not have (another verl chosen with ``--verl``) read as unset.
    """
    from omegaconf import OmegaConf

    def flag(key: str) -> Any:
        return OmegaConf.select(cfg, key, default=None)

    rm_determinism = flag("reward.reward_model.enable") and flag(
        "reward.reward_model.rollout.full_determinism"
    )
    if flag("actor_rollout_ref.rollout.full_determinism") or rm_determinism:
        environ["VERL_FULL_DETERMINISM"] = "1"
        environ["VLLM_BATCH_INVARIANT"] = "1"
        environ["PYTHONHASHSEED"] = str(flag("actor_rollout_ref.rollout.seed"))
    loggers = cfg.trainer.get("logger", [])
    if "rl_insight" in ([loggers] if isinstance(loggers, str) else loggers or []):
        environ["VERL_RL_INSIGHT_ENABLE"] = "1"


def runtime_env(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """verl's default runtime env merged with the user's (as ``run_ppo`` does), plus the memory hook."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    apply_determinism_env(cfg, os.environ)
    takes_config = bool(
        inspect.signature(get_ppo_ray_runtime_env).parameters
    )  # releases before 0.9 take none
    default = get_ppo_ray_runtime_env(cfg) if takes_config else get_ppo_ray_runtime_env()  # type: ignore[no-untyped-call]
    if OmegaConf.select(cfg, "transfer_queue.enable", default=False):  # a node since 0.9
        default.setdefault("env_vars", {})["TRANSFER_QUEUE_ENABLE"] = "1"
    user = _ray_init(cfg).get("runtime_env") or {}
    merged: dict[str, Any] = OmegaConf.to_container(OmegaConf.merge(default, user), resolve=True)  # type: ignore[assignment]
    env_vars: dict[str, str] = dict(merged.get("env_vars") or {})
    merged["env_vars"] = env_vars
    user_hook = merged.get("worker_process_setup_hook")
    if user_hook and user_hook != SETUP_HOOK:
        env_vars[USER_SETUP_HOOK_ENV] = str(user_hook)
    merged["worker_process_setup_hook"] = SETUP_HOOK
    env_vars[RUN_DIR_ENV] = str(run_dir.resolve())
    return merged


def _ray_init(cfg: Any) -> Any:
    """The user's ``ray.init`` arguments: ``ray_kwargs.ray_init``, a top-level ``ray_init`` before verl 0.6."""
    from omegaconf import OmegaConf

    for key in ("ray_kwargs.ray_init", "ray_init"):
        found = OmegaConf.select(cfg, key, default=None)
        if found is not None:
            return found
    return {}


def init_kwargs(cfg: Any, address: str | None, cpus: CpuNeed, runtime: dict[str, Any]) -> dict[str, Any]:
    """``ray.init`` arguments: the user's ``ray_kwargs.ray_init``, an explicit CPU count for a local Ray.

    A new local Ray is asked for as ``address="local"``: Ray then never attaches to another Ray it finds running.
    """
    from omegaconf import OmegaConf

    ray_init = _ray_init(cfg)
    user: dict[str, Any] = OmegaConf.to_container(ray_init, resolve=True) if ray_init else {}  # type: ignore[assignment]
    kwargs = {
        k: v for k, v in user.items() if v is not None and k not in ("runtime_env", "address", "num_cpus")
    }
    kwargs["address"] = address or "local"
    if address is None:
        kwargs["num_cpus"] = local_num_cpus(user.get("num_cpus"), cpus)
    kwargs["runtime_env"] = runtime
    return kwargs


def local_num_cpus(configured: object, cpus: CpuNeed) -> int:
    """Logical CPUs for a new local Ray: the user's count if enough, else at least what the run reserves."""
    if configured is None:
        return max(os.cpu_count() or 1, cpus.total)
    if not isinstance(configured, int) or configured < cpus.total:
        raise LaunchBlocked(
            f"ray_kwargs.ray_init.num_cpus={configured} is below the {cpus.describe()} Ray CPUs this run "
            "reserves; Ray would wait forever without a word",
            where="ray_kwargs.ray_init.num_cpus",
            fix=f"ray_kwargs.ray_init.num_cpus={cpus.total} (logical CPUs: oversubscribing is fine), "
            "or leave it unset",
        )
    return configured


def plan_launch(
    cfg: Any, view: ConfigView, run_dir: Path, env: Mapping[str, str], import_path: str | None = None
) -> LaunchPlan:
    """Decide everything ``run`` will start; pure apart from reading verl's default runtime env.

    ``import_path``: a directory Ray's workers must import verl from (``--verl``), put first on their PYTHONPATH.
    """
    address, source = ray_address(view, env)
    gpus = gpu_need(view)
    cpus = cpu_need(view, gpus)
    runtime = runtime_env(cfg, run_dir)
    if import_path is not None:
        env_vars = runtime["env_vars"]
        env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (import_path, env_vars.get("PYTHONPATH")) if p)
    kwargs = init_kwargs(cfg, address, cpus, runtime)
    runner = RUNNER_V1 if view.get("trainer.use_v1") else _v0_runner()
    auth = ray_auth(address, env)
    return LaunchPlan(address, source, auth, kwargs, gpus, cpus, runner, run_dir)


def _v0_runner() -> str:
    """verl's v0 task runner: in ``main_ppo_v0`` since 0.9, in ``main_ppo`` before (another verl, ``--verl``)."""
    from verl_safe_launch.inputs import verl_package_dir

    return RUNNER_V0 if (verl_package_dir() / "trainer" / "main_ppo_v0.py").is_file() else RUNNER_BEFORE_09


def render_plan(plan: LaunchPlan) -> str:
    """The plan as text: Ray address, resources, runtime env and task runner."""
    where = plan.address or "a new local Ray on this machine"
    lines = [
        f"  Ray:          {where} ({plan.address_source}), RAY_AUTH_MODE={plan.auth.mode}",
        f"  Ray auth:     {plan.auth.describe()}",
        f"  GPUs needed:  {plan.gpus.describe()}",
        f"  CPUs needed:  {plan.cpus.describe()}",
    ]
    if "num_cpus" in plan.init_kwargs:
        lines.append(f"  ray.init:     num_cpus={plan.init_kwargs['num_cpus']}")
    runtime = plan.init_kwargs.get("runtime_env", {})
    lines.append(f"  setup hook:   {runtime.get('worker_process_setup_hook')}")
    env_vars = runtime.get("env_vars", {})
    lines.append(
        "  worker env:   " + (", ".join(f"{k}={v}" for k, v in sorted(env_vars.items())) or "(none)")
    )
    lines.append(f"  task runner:  {plan.task_runner}")
    lines.append(f"  run dir:      {plan.run_dir}")
    return "\n".join(lines)

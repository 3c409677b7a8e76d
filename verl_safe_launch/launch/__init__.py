"""The launch: plan, run directory, verl hand-off on Ray, worker memory hooks, post-mortem, Slurm."""

from __future__ import annotations

from verl_safe_launch.launch.hook_stages import STAGE_BY_NAME
from verl_safe_launch.launch.hooks import (
    NO_CUDA_NOTE,
    RUN_DIR_ENV,
    SETUP_HOOK,
    USER_SETUP_HOOK_ENV,
    install,
    patch_module,
    wrap_stage,
)
from verl_safe_launch.launch.plan import (
    LaunchBlocked,
    LaunchPlan,
    auth_mode,
    local_num_cpus,
    plan_launch,
    ray_address,
    render_plan,
)
from verl_safe_launch.launch.postmortem import (
    NO_FIT,
    first_oom,
    load_fit,
    oom_report,
    read_records,
    render_peaks,
)
from verl_safe_launch.launch.rundir import (
    RUN_FILES,
    atomic_write,
    auto_run_dir,
    config_digest,
    prepare_run_dir,
    reproduce_command,
    run_dir_arg,
)
from verl_safe_launch.launch.slurm import Container, SlurmSpec, render_sbatch, sbatch_options
from verl_safe_launch.launch.slurm_job import (
    Joined,
    RayNode,
    allocation_lines,
    joined_line,
    missing_error,
    wait_for_nodes,
)
from verl_safe_launch.launch.verl_handoff import (
    cause_line,
    check_cpus,
    check_gpus,
    local_gpu_count,
    validate_with_verl,
)

__all__ = [
    "NO_CUDA_NOTE",
    "NO_FIT",
    "RUN_DIR_ENV",
    "RUN_FILES",
    "SETUP_HOOK",
    "STAGE_BY_NAME",
    "USER_SETUP_HOOK_ENV",
    "Container",
    "Joined",
    "LaunchBlocked",
    "LaunchPlan",
    "RayNode",
    "SlurmSpec",
    "allocation_lines",
    "atomic_write",
    "auth_mode",
    "auto_run_dir",
    "cause_line",
    "check_cpus",
    "check_gpus",
    "config_digest",
    "first_oom",
    "install",
    "joined_line",
    "load_fit",
    "local_gpu_count",
    "local_num_cpus",
    "missing_error",
    "oom_report",
    "patch_module",
    "plan_launch",
    "prepare_run_dir",
    "ray_address",
    "read_records",
    "render_peaks",
    "render_plan",
    "render_sbatch",
    "reproduce_command",
    "run_dir_arg",
    "sbatch_options",
    "validate_with_verl",
    "wait_for_nodes",
    "wrap_stage",
]

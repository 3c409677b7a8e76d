"""The local run: launch plan, run directory, verl hand-off on Ray, worker memory hooks, Ray auth, placement."""

from __future__ import annotations

from verl_safe_launch.launch.deadline import within
from verl_safe_launch.launch.hook_stages import STAGE_BY_NAME, STAGES
from verl_safe_launch.launch.hooks import (
    NO_CUDA_NOTE,
    RUN_DIR_ENV,
    SETUP_HOOK,
    USER_SETUP_HOOK_ENV,
    WORKERS_FILE,
    install,
    patch_module,
    wrap_stage,
)
from verl_safe_launch.launch.model_access import describe_exception, model_access_error
from verl_safe_launch.launch.nodes import (
    NodeInfo,
    NodeNeed,
    blocking,
    live_nodes,
    node_findings,
    node_need,
    nodes_from_ray,
    nodes_from_state,
)
from verl_safe_launch.launch.placement import bundles, probe_placement
from verl_safe_launch.launch.plan import (
    LaunchBlocked,
    LaunchPlan,
    auth_mode,
    local_num_cpus,
    plan_launch,
    ray_address,
    render_plan,
)
from verl_safe_launch.launch.ray_auth import (
    NEW_TOKEN,
    AuthMismatch,
    RayAuth,
    auth_env,
    ray_auth,
    token_source,
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
from verl_safe_launch.launch.verl_handoff import (
    cause_line,
    check_cpus,
    check_gpus,
    failed_worker,
    import_chosen_verl,
    local_gpu_count,
    validate_with_verl,
)

__all__ = [
    "NEW_TOKEN",
    "NO_CUDA_NOTE",
    "RUN_DIR_ENV",
    "RUN_FILES",
    "SETUP_HOOK",
    "STAGES",
    "STAGE_BY_NAME",
    "USER_SETUP_HOOK_ENV",
    "WORKERS_FILE",
    "AuthMismatch",
    "LaunchBlocked",
    "LaunchPlan",
    "NodeInfo",
    "NodeNeed",
    "RayAuth",
    "atomic_write",
    "auth_env",
    "auth_mode",
    "auto_run_dir",
    "blocking",
    "bundles",
    "cause_line",
    "check_cpus",
    "check_gpus",
    "config_digest",
    "describe_exception",
    "failed_worker",
    "import_chosen_verl",
    "install",
    "live_nodes",
    "local_gpu_count",
    "local_num_cpus",
    "model_access_error",
    "node_findings",
    "node_need",
    "nodes_from_ray",
    "nodes_from_state",
    "patch_module",
    "plan_launch",
    "prepare_run_dir",
    "probe_placement",
    "ray_address",
    "ray_auth",
    "render_plan",
    "reproduce_command",
    "run_dir_arg",
    "token_source",
    "validate_with_verl",
    "within",
    "wrap_stage",
]

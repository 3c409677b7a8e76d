"""The launch plan: GPU and CPU needs, Ray address and auth mode, runtime env merge, and the pre-Ray checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import EXAMPLES

from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.launch import (
    NEW_TOKEN,
    RUN_DIR_ENV,
    SETUP_HOOK,
    USER_SETUP_HOOK_ENV,
    AuthMismatch,
    LaunchBlocked,
    RayAuth,
    auth_env,
    auth_mode,
    cause_line,
    check_cpus,
    check_gpus,
    failed_worker,
    local_num_cpus,
    plan_launch,
    ray_address,
    ray_auth,
    render_plan,
)
from verl_safe_launch.rules import CpuNeed, GpuNeed, cpu_need, gpu_need

EXAMPLE = EXAMPLES / "grpo_6gpu.yaml"


def composed(*overrides: str) -> Composed:
    return compose(ComposeRequest(overrides=cli_tokens(list(overrides)), config_files=(EXAMPLE,)))


@pytest.mark.parametrize(
    ("overrides", "total", "parts"),
    [
        ((), 6, ("global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1",)),
        (
            (
                "reward.reward_model.enable=true",
                "reward.reward_model.enable_resource_pool=true",
                "reward.reward_model.n_gpus_per_node=2",
                "reward.reward_model.nnodes=1",
            ),
            8,
            (
                "global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1",
                "reward pool 2 = reward.reward_model.n_gpus_per_node 2 × nnodes 1",
            ),
        ),
        (
            ("distillation.enabled=true", "distillation.n_gpus_per_node=4", "distillation.nnodes=2"),
            14,
            (
                "global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1",
                "teacher pool 8 = distillation.n_gpus_per_node 4 × nnodes 2",
            ),
        ),
    ],
)
def test_gpu_need_counts_every_pool(overrides: tuple[str, ...], total: int, parts: tuple[str, ...]) -> None:
    need = gpu_need(composed(*overrides).view)
    assert (need.total, need.parts) == (total, parts)


@pytest.mark.parametrize(
    ("overrides", "total"),
    [
        ((), 3 * 6 + 9 + 1),
        (("trainer.use_v1=false",), 3 * 6 + 1),
        (("trainer.n_gpus_per_node=1",), 3 + 9 + 1),
    ],
)
def test_cpu_need_includes_transfer_queue_for_the_v1_trainer(overrides: tuple[str, ...], total: int) -> None:
    view = composed(*overrides).view
    assert cpu_need(view, gpu_need(view)).total == total


def test_ray_address_prefers_the_config_then_the_environment() -> None:
    plain = composed().view
    configured = composed("+ray_kwargs.ray_init.address=10.0.0.9:6379").view
    assert ray_address(plain, {}) == (None, "local")
    assert ray_address(plain, {"RAY_ADDRESS": "auto"}) == ("auto", "RAY_ADDRESS")
    assert ray_address(configured, {"RAY_ADDRESS": "auto"}) == (
        "10.0.0.9:6379",
        "ray_kwargs.ray_init.address",
    )


@pytest.mark.parametrize(
    ("address", "env", "token_file", "mode"),
    [
        (None, {}, False, "token"),
        (None, {"RAY_AUTH_MODE": "disabled"}, False, "disabled"),
        ("10.0.0.1:6379", {}, False, "disabled"),
        ("10.0.0.1:6379", {}, True, "token"),
        ("10.0.0.1:6379", {"RAY_AUTH_TOKEN": "abc"}, False, "token"),
    ],
)
def test_one_auth_mode_for_everything(
    tmp_path: Path, address: str | None, env: dict[str, str], token_file: bool, mode: str
) -> None:
    token = tmp_path / "auth_token"
    if token_file:
        token.write_text("secret")
    assert auth_mode(address, {**env, "RAY_AUTH_TOKEN_PATH": str(token)}) == mode


@pytest.mark.parametrize(
    ("address", "env", "mode", "why", "token"),
    [
        (None, {}, "token", "Ray's default for a new local Ray", NEW_TOKEN),
        (None, {"RAY_AUTH_MODE": "token"}, "token", "RAY_AUTH_MODE=token", NEW_TOKEN),
        (
            None,
            {"RAY_AUTH_TOKEN": "abc"},
            "token",
            "Ray's default for a new local Ray",
            "token from RAY_AUTH_TOKEN",
        ),
        (
            None,
            {"HOME": "{home}"},
            "token",
            "Ray's default for a new local Ray",
            "token from ~/.ray/auth_token",
        ),
        (
            None,
            {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "abc"},
            "disabled",
            "RAY_AUTH_MODE=disabled",
            "",
        ),
        ("10.0.0.1:6379", {}, "disabled", "no token available", ""),
        (
            "10.0.0.1:6379",
            {"HOME": "{home}"},
            "token",
            "a token is available",
            "token from ~/.ray/auth_token",
        ),
    ],
)
def test_ray_auth_says_which_mode_why_and_where_the_token_comes_from(
    tmp_path: Path, address: str | None, env: dict[str, str], mode: str, why: str, token: str
) -> None:
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("secret\n")
    empty_home = tmp_path / "empty"
    env = {"HOME": str(empty_home), **{k: v.replace("{home}", str(home)) for k, v in env.items()}}
    auth = ray_auth(address, env)
    assert (auth.mode, auth.why, auth.token) == (mode, why, token)
    assert auth.new_token == (token == NEW_TOKEN)
    assert "secret" not in auth.describe() + str(auth.to_json())


def test_token_auth_for_a_cluster_without_any_token_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AuthMismatch) as info:
        ray_auth("10.0.0.1:6379", {"RAY_AUTH_MODE": "token", "HOME": str(tmp_path)})
    assert info.value.exit_code == 1
    assert info.value.render().splitlines() == [
        "error: RAY_AUTH_MODE=token asks for token authentication with the Ray cluster at 10.0.0.1:6379, "
        "but this process has no token",
        "  where: RAY_AUTH_MODE in the environment; no RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token",
        "  fix: export the cluster's token as RAY_AUTH_TOKEN=... (or RAY_AUTH_TOKEN_PATH=FILE), "
        "or RAY_AUTH_MODE=disabled if the cluster was started with it",
    ]


def test_a_configured_cpu_count_below_the_need_is_refused_before_ray_starts() -> None:
    with pytest.raises(LaunchBlocked) as info:
        local_num_cpus(4, CpuNeed(18, 9))
    assert info.value.exit_code == 1
    assert info.value.render().splitlines() == [
        "error: ray_kwargs.ray_init.num_cpus=4 is below the 28 (GPU bundles 18 + TransferQueue 9 + scheduling 1) "
        "Ray CPUs this run reserves; Ray would wait forever without a word",
        "  where: ray_kwargs.ray_init.num_cpus",
        "  fix: ray_kwargs.ray_init.num_cpus=28 (logical CPUs: oversubscribing is fine), or leave it unset",
    ]
    assert local_num_cpus(None, CpuNeed(3, 9)) >= 13
    assert local_num_cpus(64, CpuNeed(3, 9)) == 64


def test_cluster_checks_name_both_numbers() -> None:
    need = GpuNeed(6, parts=("global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1",))
    assert check_gpus(need, {"GPU": 8.0}, "here") is None
    error = check_gpus(need, {"CPU": 64.0}, "Ray cluster 10.0.0.1:6379")
    assert error is not None and error.exit_code == 3
    assert error.what == (
        "the Ray cluster has 0 GPUs; the config needs 6 (global pool 6 = trainer.n_gpus_per_node 6 × trainer.nnodes 1)"
    )
    cpu_error = check_cpus(CpuNeed(18, 9), {"CPU": 16.0}, "here")
    assert cpu_error is not None
    assert cpu_error.what.startswith("the Ray cluster has 16 CPUs; this run reserves 28 (")


def test_cause_line_takes_the_original_exception_of_a_ray_task_error() -> None:
    class FakeRayTaskError(Exception):
        cause = ValueError("Total available GPUs 0 is less than total desired GPUs 1\nmore")

    assert cause_line(FakeRayTaskError("traceback...")) == (
        "ValueError: Total available GPUs 0 is less than total desired GPUs 1"
    )


def test_cause_line_goes_down_nested_task_errors_and_names_the_innermost_worker() -> None:
    class TaskError(Exception):  # Ray's RayTaskError(...) keeps the original exception as .cause
        def __init__(self, text: str, cause: BaseException) -> None:
            super().__init__(text)
            self.cause = cause

    original = RuntimeError("Distributed package doesn't have NCCL built in\ntraceback")
    text = (  # Ray's own rendering: the task runner's frame, then the worker's
        "\x1b[36mray::ObservedTaskRunnerV1.run()\x1b[39m (pid=11, ip=10.0.0.2, actor_id=ab)\n  File ...\n"
        "ray.exceptions.RayTaskError(RuntimeError): \x1b[36mray::WorkerDict.actor_rollout_init_model()\x1b[39m "
        "(pid=12, ip=10.0.0.3, actor_id=cd, repr=<WorkerDict>)\nRuntimeError: ..."
    )
    error = TaskError(text, TaskError("inner", original))
    assert cause_line(error) == "RuntimeError: Distributed package doesn't have NCCL built in"
    assert failed_worker(error) == "WorkerDict.actor_rollout_init_model (pid 12, 10.0.0.3)"
    assert failed_worker(ValueError("no Ray task here")) is None


@pytest.mark.slow
def test_plan_merges_verls_runtime_env_the_users_and_the_hook(tmp_path: Path) -> None:
    comp = composed(
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_LOGGING_LEVEL=DEBUG",
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=my_pkg.setup",
        "ray_kwargs.ray_init.num_cpus=64",
    )
    plan = plan_launch(comp.cfg, comp.view, tmp_path, {"HOME": str(tmp_path)})
    runtime = plan.init_kwargs["runtime_env"]
    assert runtime["worker_process_setup_hook"] == SETUP_HOOK
    env = runtime["env_vars"]
    assert env[USER_SETUP_HOOK_ENV] == "my_pkg.setup"
    assert env[RUN_DIR_ENV] == str(tmp_path.resolve())
    assert env["VERL_LOGGING_LEVEL"] == "DEBUG"
    assert env["VERL_FULL_DETERMINISM"] == "0"  # from verl's get_ppo_ray_runtime_env
    assert plan.init_kwargs["num_cpus"] == 64
    assert plan.init_kwargs["address"] == "local"  # never another Ray found running on this machine
    assert f"  Ray auth:     token (Ray's default for a new local Ray), {NEW_TOKEN}" in render_plan(plan)
    assert plan.to_json()["ray_auth"]["token_source"] == NEW_TOKEN
    attached = plan_launch(comp.cfg, comp.view, tmp_path, {"RAY_ADDRESS": "10.0.0.1:6379"})
    assert attached.init_kwargs["address"] == "10.0.0.1:6379"
    assert "num_cpus" not in attached.init_kwargs  # Ray refuses resource counts when attaching


@pytest.mark.slow
def test_full_determinism_reaches_the_workers_as_in_run_ppo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("VERL_FULL_DETERMINISM", "VLLM_BATCH_INVARIANT", "PYTHONHASHSEED", "VERL_RL_INSIGHT_ENABLE"):
        monkeypatch.setenv(key, "")  # recorded, so that what the plan sets (as run_ppo does) is undone after
        monkeypatch.delenv(key)
    comp = composed("actor_rollout_ref.rollout.full_determinism=true", "actor_rollout_ref.rollout.seed=7")
    env = plan_launch(comp.cfg, comp.view, tmp_path, {}).init_kwargs["runtime_env"]["env_vars"]
    assert (env["VERL_FULL_DETERMINISM"], env["VLLM_BATCH_INVARIANT"], env["PYTHONHASHSEED"]) == (
        "1",
        "1",
        "7",
    )


@pytest.mark.slow
def test_a_new_token_lives_in_the_environment_only_while_ray_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "")
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    with auth_env(RayAuth("token", "Ray's default for a new local Ray", NEW_TOKEN)):
        assert os.environ["RAY_AUTH_MODE"] == "token"
        first = os.environ["RAY_AUTH_TOKEN"]
        assert len(first) == 64
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ
    with auth_env(RayAuth("token", "Ray's default for a new local Ray", NEW_TOKEN)):
        assert os.environ["RAY_AUTH_TOKEN"] != first  # one token per run
    monkeypatch.setenv("RAY_AUTH_TOKEN", "mine")
    with auth_env(RayAuth("token", "a token is available", "token from RAY_AUTH_TOKEN")):
        assert os.environ["RAY_AUTH_TOKEN"] == "mine"
    assert os.environ["RAY_AUTH_TOKEN"] == "mine"

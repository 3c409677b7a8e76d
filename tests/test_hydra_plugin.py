"""The Hydra plugin: presets found by verl's own entry point, and the pre-flight callback inside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, make_tiny_model

from hydra_plugins.verl_safe_launch.callback import ENABLE_OVERRIDE, preflight_report, tool_token
from hydra_plugins.verl_safe_launch.search_path import VerlSafeLaunchSearchPathPlugin
from verl_safe_launch.compose import compose
from verl_safe_launch.config_view import flatten
from verl_safe_launch.inputs import ComposeRequest, cli_tokens

VERL_MAIN = ("-m", "verl.trainer.main_ppo")
# verl's real entry point, with its validate_config wrapped: run it, print what verl received, stop before Ray.
PROBED_MAIN = (
    "-c",
    "import runpy, sys, verl.utils.config as c\n"
    "real = c.validate_config\n"
    "def probe(config, *args, **kwargs):\n"
    "    real(config, *args, **kwargs)\n"
    "    a = config.actor_rollout_ref\n"
    "    print('VERL_VALIDATED', config.data.train_batch_size, config.trainer.n_gpus_per_node,\n"
    "          a.actor.ppo_micro_batch_size_per_gpu, a.rollout.n, a.rollout.tensor_model_parallel_size,\n"
    "          flush=True)\n"
    "    raise SystemExit(0)\n"
    "c.validate_config = probe\n"
    "sys.argv = ['main_ppo', *sys.argv[1:]]\n"
    "runpy.run_module('verl.trainer.main_ppo', run_name='__main__', alter_sys=True)\n",
)


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only declared hardware counts in these tests, whatever machine runs them."""
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("+preset=medium", "preset=medium"),
        ("++preset=small", "preset=small"),
        ("+hardware.gpus_per_node=4", "hardware.gpus_per_node=4"),
        ("+trainer.val_before_train=false", "+trainer.val_before_train=false"),
        ("data.train_batch_size=8", "data.train_batch_size=8"),
    ],
)
def test_hydra_spellings_of_tool_tokens(text: str, expected: str) -> None:
    assert tool_token(text) == expected


def test_search_path_plugin_adds_the_preset_package() -> None:
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl

    path = ConfigSearchPathImpl()
    VerlSafeLaunchSearchPathPlugin().manipulate_search_path(path)
    assert [(p.provider, p.path) for p in path.get_path()] == [
        ("verl-safe-launch", "pkg://verl_safe_launch.conf")
    ]


def test_preflight_report_stops_on_errors() -> None:
    code, text = preflight_report(["+preset=medium", "+hardware.gpus_per_node=4"])
    assert code == 1
    assert text.startswith(
        "verl-safe-launch pre-flight (inside verl's entry point; presets are not adapted here)\n"
    )
    assert (
        "error [hardware-mismatch] trainer.n_gpus_per_node=8 asks for more GPUs per node than the hardware has (4)\n"
        "  trainer.n_gpus_per_node = 8      from preset medium, conf/preset/medium.yaml:15\n"
        "  hardware.gpus_per_node  = 4      from hardware: declared on the command line (+hardware.gpus_per_node=4)\n"
    ) in text
    assert text.splitlines()[-1].startswith("NO-GO: ")


def test_the_report_checks_the_values_hydra_hands_to_verl() -> None:
    overrides = ["+preset=medium", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm"]
    ours = compose(ComposeRequest(overrides=cli_tokens([o.lstrip("+") for o in overrides])))
    values = {**ours.view.values, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 7}
    code, text = preflight_report(overrides, values)
    assert code == 1
    assert "error [batch-micro-divides-mini] actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7" in text
    assert preflight_report(overrides, dict(ours.view.values))[0] == 0


def test_a_literal_preset_key_is_an_error_naming_the_fix() -> None:
    code, text = preflight_report(["+preset=medium"], {"preset": "medium", "data.train_batch_size": 1024})
    assert code == 1
    assert text.splitlines()[1] == (
        "error [preset-not-found] +preset=medium reached verl as a literal key 'preset: medium': Hydra did not "
        "find verl-safe-launch's preset config group, so verl runs its own defaults"
    )
    assert "fix: install verl-safe-launch into the Python that runs verl" in text


def test_a_hardware_token_in_verls_config_is_an_error_naming_the_callback_setting() -> None:
    code, text = preflight_report(["+hardware.gpus_per_node=4"], {"hardware.gpus_per_node": 4})
    assert code == 1
    assert text.splitlines()[1:] == [
        "error [tool-token-in-config] +hardware.gpus_per_node=4 reached verl as a config key "
        "'hardware.gpus_per_node': the hardware is declared to the pre-flight callback, not to verl",
        "  fix: +hydra.callbacks.vsl.gpus_per_node=4 (instead of +hardware.gpus_per_node=4)",
    ]


def test_hardware_declared_to_the_callback_reaches_the_preflight() -> None:
    overrides = ["+preset=medium", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm"]
    ours = compose(ComposeRequest(overrides=cli_tokens([o.lstrip("+") for o in overrides])))
    code, text = preflight_report(overrides, dict(ours.view.values), {"gpus_per_node": 4})
    assert code == 1
    assert "  hardware.gpus_per_node  = 4      from hardware: declared on the command line " in text
    assert "(+hydra.callbacks.vsl.gpus_per_node=4)" in text


def test_flatten_keeps_lists_as_leaves() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": 1, "a.c": [1, 2], "d": {}}


@pytest.mark.slow
def test_presets_resolve_from_any_directory(tmp_path: Path) -> None:
    env = {**os.environ, "VSL_HARDWARE_DETECT": "0"}
    command = [sys.executable, *VERL_MAIN, "+preset=medium", "--cfg", "job"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "  train_batch_size: 48\n" in done.stdout
    assert "\npreset:" not in done.stdout


def _run(args: tuple[str, ...], overrides: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VSL_HARDWARE_DETECT": "0", "HYDRA_FULL_ERROR": "1"}
    command = [sys.executable, *args, *overrides, ENABLE_OVERRIDE, f"hydra.run.dir={tmp_path / 'hydra'}"]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
def test_verl_entry_point_gets_preset_values_after_a_clean_preflight(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny-model")
    overrides = [
        "+preset=small",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={model}",
    ]
    done = _run(PROBED_MAIN, overrides, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verl-safe-launch pre-flight (inside verl's entry point" in done.stderr
    assert "GO: 0 errors" in done.stderr
    assert "VERL_VALIDATED 16 2 4 8 1" in done.stdout, "verl validated and received preset small's values"


@pytest.mark.slow
def test_bad_override_is_stopped_by_our_report_before_verl_validates(tmp_path: Path) -> None:
    # 49 prompts × 12 samples = 588 trajectories on 8 GPUs: verl's own validate_config would refuse it
    # ("real_train_batch_size (588) must be divisible by minimal possible batch size (8)"); the declared
    # 4-GPU machine contradicts preset medium's 8 GPUs per node, which only the pre-flight knows.
    overrides = ["+preset=medium", "+hydra.callbacks.vsl.gpus_per_node=4", "data.train_batch_size=49"]
    done = _run(VERL_MAIN, overrides, tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "error [hardware-mismatch] trainer.n_gpus_per_node=8 asks for more GPUs per node" in done.stderr
    assert "NO-GO:" in done.stderr
    assert "minimal possible batch size" not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_an_interpolation_bomb_through_verls_entry_point_stops_at_the_limit() -> None:
    """The callback never resolves a bomb itself; our composition of the same overrides names the limit."""
    from omegaconf import OmegaConf

    from hydra_plugins.verl_safe_launch.callback import task_values

    overrides = ["+trainer.x0=ab"]
    overrides += [f"+trainer.x{i}=${{trainer.x{i - 1}}}${{trainer.x{i - 1}}}" for i in range(1, 16)]
    values = {
        "trainer": {
            "x0": "ab",
            **{f"x{i}": f"${{trainer.x{i - 1}}}${{trainer.x{i - 1}}}" for i in range(1, 16)},
        }
    }
    flat = task_values(OmegaConf.create(values))
    assert flat["trainer.x15"] == "${trainer.x14}${trainer.x14}"  # left unresolved
    code, text = preflight_report(overrides, flat)
    assert code == 2
    assert (
        "error: interpolation limit: " in text and "4,000 steps (the limit), trainer.x10 among them" in text
    )
    assert "where: command line (+trainer.x10=${trainer.x9}${trainer.x9})" in text

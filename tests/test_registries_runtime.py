"""What verl and its engines accept at run time, read from their source: the group advantage estimators (with one
response per prompt there is no group), and the load formats of the engines verl 0.9.1 passes ``load_format`` to.

Oracles: verl's own estimator registry and functions (imported and run), and the engines' own source installed
with ``pip --no-deps --target`` at the versions verl 0.9.1's extras pin.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult
from engine_sources import SGLANG, VLLM, cache_root, unpacked_wheel

from verl_safe_launch.inputs import engine_formats_json, read_group_estimators, read_group_of_one_raises

ARR = "actor_rollout_ref"
BASE = (
    f"{ARR}.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    f"{ARR}.rollout.name=vllm",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=2",
    f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=2",
)


def _installed_root() -> Path:
    import verl

    return Path(verl.__file__).parent.parent


@pytest.mark.slow  # imports verl (torch)
def test_group_estimators_read_from_source_are_those_whose_function_takes_the_group_index() -> None:
    from verl.trainer.ppo import core_algos

    imported = {
        name
        for name, fn in core_algos.ADV_ESTIMATOR_REGISTRY.items()
        if "index" in inspect.signature(fn).parameters
    }
    assert set(read_group_estimators(_installed_root())) == imported
    assert "grpo" in imported and "gae" not in imported


def test_group_estimators_of_old_releases_come_from_compute_advantage(tmp_path: Path) -> None:
    """Before 0.4 an estimator was a branch of ``compute_advantage``; the group ones pass ``index=``."""
    trainer = tmp_path / "verl" / "trainer" / "ppo" / "ray_trainer.py"
    trainer.parent.mkdir(parents=True)
    trainer.write_text(
        "class AdvantageEstimator:\n    GAE = 'gae'\n    GRPO = 'grpo'\n\n"
        "def compute_advantage(data, adv_estimator):\n"
        "    if adv_estimator == AdvantageEstimator.GAE:\n        a = gae(data, gamma=1)\n"
        "    elif adv_estimator == AdvantageEstimator.GRPO:\n        a = grpo(data, index=data.uid)\n"
        "    elif adv_estimator == 'rloo':\n        a = rloo(data, index=data.uid)\n"
    )
    assert read_group_estimators(tmp_path) == ["grpo", "rloo"]


@pytest.mark.slow  # imports verl (torch)
def test_with_one_response_per_prompt_grpo_and_rloo_have_no_baseline() -> None:
    """What the rule's message says, run on verl's own functions: a group of one is mean 0, std 1 for grpo (the
    advantage is the reward itself), rloo gives the reward too, and rloo_vectorized gives 0."""
    import numpy as np
    import torch
    from verl.trainer.ppo import core_algos

    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    index = np.array(["a", "b", "c", "d"], dtype=object)
    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    got = {
        name: registry[name](token_level_rewards=rewards, response_mask=torch.ones(4, 3), index=index)[0][
            :, -1
        ]
        for name in ("grpo", "rloo", "rloo_vectorized")
    }
    assert torch.allclose(got["grpo"], rewards[:, -1], atol=1e-4)
    assert torch.allclose(got["rloo"], rewards[:, -1])
    assert torch.equal(got["rloo_vectorized"], torch.zeros(4))


@pytest.mark.slow  # imports verl (torch)
def test_the_estimators_read_as_raising_on_a_group_of_one_are_those_verls_own_code_makes_raise() -> None:
    """Every group estimator of verl 0.9.1, run on four prompts with one response each: the ones that raise are
    the ones ``read_group_of_one_raises`` reads from the source (grpo_passk: 'requires at least 2 samples')."""
    import numpy as np
    import torch
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.5])
    index = np.array(["a", "b", "c", "d"], dtype=object)
    raised = set()
    for name in read_group_estimators(_installed_root()):
        fn = core_algos.ADV_ESTIMATOR_REGISTRY[name]
        given = {
            "token_level_rewards": rewards,
            "response_mask": torch.ones(4, 3),
            "index": index,
            "config": AlgoConfig(),
            "old_log_probs": torch.zeros(4, 3),
            "sum_pi_squared": torch.ones(4, 3),
            "rollout_is_weights": torch.ones(4, 3),
        }
        wanted = inspect.signature(fn).parameters
        try:
            fn(**{k: v for k, v in given.items() if k in wanted})
        except ValueError:
            raised.add(name)
    assert raised == set(read_group_of_one_raises(_installed_root())) == {"grpo_passk"}


def test_check_refuses_an_estimator_that_raises_on_a_group_of_one(cli: Callable[..., CliResult]) -> None:
    result = cli(
        "check", *BASE, "algorithm.adv_estimator=grpo_passk", f"{ARR}.rollout.n=1", "--format", "json"
    )
    [found] = [f for f in json.loads(result.out)["findings"] if f["rule_id"] == "verl-group-estimator-n"]
    assert (
        result.code == 1 and found["severity"] == "error" and "raises on a group of one" in found["message"]
    )
    fixed = cli(
        "check", *BASE, "algorithm.adv_estimator=grpo_passk", f"{ARR}.rollout.n=5", "--format", "json"
    )
    assert not [f for f in json.loads(fixed.out)["findings"] if f["rule_id"] == "verl-group-estimator-n"]


@pytest.mark.parametrize(
    ("overrides", "rule", "severity", "fixed"),
    [
        (
            ("algorithm.adv_estimator=grpo", f"{ARR}.rollout.n=1"),
            "verl-group-estimator-n",
            "warning",
            f"{ARR}.rollout.n=5",
        ),
        (
            ("algorithm.adv_estimator=rloo", f"{ARR}.rollout.n=1"),
            "verl-group-estimator-n",
            "warning",
            f"{ARR}.rollout.n=5",
        ),
        (
            (f"{ARR}.rollout.load_format=dummy_dtensor",),
            "verl-load-format",
            "error",
            f"{ARR}.rollout.load_format=dummy",
        ),
    ],
)
def test_check_flags_what_verl_or_its_engine_refuses_or_runs_other_than_named(
    cli: Callable[..., CliResult], overrides: tuple[str, ...], rule: str, severity: str, fixed: str
) -> None:
    """An unknown load format stops the rollout server (an error); a group estimator with one response per prompt
    runs, as the test above shows on verl's own functions, but not as the estimator it names (a warning)."""
    result = cli("check", *BASE, *overrides, "--format", "json")
    findings = [f for f in json.loads(result.out)["findings"] if f["rule_id"] == rule]
    assert result.code == (1 if severity == "error" else 0), result.out
    assert len(findings) == 1 and findings[0]["severity"] == severity
    assert fixed in (findings[0]["fix"] or "")
    after = cli("check", *BASE, *overrides, fixed, "--format", "json")
    assert not [f for f in json.loads(after.out)["findings"] if f["rule_id"] == rule]


def test_a_fork_key_carrying_the_group_size_keeps_the_group_rule_quiet(cli: Callable[..., CliResult]) -> None:
    """Search-R1's fork samples ``rollout.n_agent`` responses per prompt and leaves ``rollout.n`` at 1."""
    overrides = ("algorithm.adv_estimator=grpo", f"{ARR}.rollout.n=1")
    quiet = cli("check", *BASE, *overrides, f"+{ARR}.rollout.n_agent=5", "--format", "json")
    loud = cli("check", *BASE, *overrides, f"+{ARR}.rollout.n_agent=1", "--format", "json")
    rules = [{f["rule_id"] for f in json.loads(r.out)["findings"]} for r in (quiet, loud)]
    assert "verl-group-estimator-n" not in rules[0] and "verl-group-estimator-n" in rules[1]


def test_distillation_without_task_rewards_reads_no_advantage_so_the_group_rule_stays_quiet(
    cli: Callable[..., CliResult],
) -> None:
    """verl's own on-policy distillation examples run GRPO with one response per prompt and
    ``use_task_rewards=False``. The premise, read in verl's source: under that switch the policy loss, the only
    reader of the advantages, is set to 0. With task rewards on, the group rule speaks again."""
    import ast

    import verl.trainer.distillation.losses as losses

    tree = ast.parse(Path(losses.__file__).read_text())
    zeroed = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "not distillation_loss_config.use_task_rewards"
        and any(ast.unparse(stmt) == "policy_loss = 0.0" for stmt in node.body)
    ]
    assert zeroed, "verl no longer zeroes the policy loss without task rewards: the rule's premise is gone"
    group = ("algorithm.adv_estimator=grpo", f"{ARR}.rollout.n=1", "distillation.enabled=true")
    quiet = cli(
        "check", *BASE, *group, "distillation.distillation_loss.use_task_rewards=false", "--format", "json"
    )
    loud = cli(
        "check", *BASE, *group, "distillation.distillation_loss.use_task_rewards=true", "--format", "json"
    )
    rules = [{f["rule_id"] for f in json.loads(r.out)["findings"]} for r in (quiet, loud)]
    assert "verl-group-estimator-n" not in rules[0] and "verl-group-estimator-n" in rules[1]


def test_a_run_that_only_validates_computes_no_advantage_so_the_group_rule_stays_quiet(
    cli: Callable[..., CliResult],
) -> None:
    """The premise, read in verl's trainer: ``fit`` returns after the validation before training when
    ``trainer.val_only`` is set. Without that validation (``val_before_train=false``) it trains, and the rule
    speaks, as an error for grpo_passk."""
    import ast

    tree = ast.parse((_installed_root() / "verl" / "trainer" / "ppo" / "ray_trainer.py").read_text())
    returns = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and "val_before_train" in ast.unparse(node.test)
        and any(
            isinstance(inner, ast.If)
            and "val_only" in ast.unparse(inner.test)
            and any(isinstance(stmt, ast.Return) for stmt in inner.body)
            for inner in node.body
        )
    ]
    assert returns, "verl's fit no longer returns after validating when val_only is set"
    group = ("algorithm.adv_estimator=grpo_passk", f"{ARR}.rollout.n=1", "trainer.val_only=true")
    quiet = cli("check", *BASE, *group, "--format", "json")
    loud = cli("check", *BASE, *group, "trainer.val_before_train=false", "--format", "json")
    rules = [{f["rule_id"] for f in json.loads(r.out)["findings"]} for r in (quiet, loud)]
    assert "verl-group-estimator-n" not in rules[0] and "verl-group-estimator-n" in rules[1]
    assert loud.code == 1


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.adv_estimator=grpo", f"{ARR}.rollout.n=4"),
        ("algorithm.adv_estimator=gae", f"{ARR}.rollout.n=1"),
        (f"{ARR}.rollout.name=sglang", f"{ARR}.rollout.load_format=layered"),
        (f"{ARR}.rollout.load_format=safetensors",),
    ],
)
def test_check_accepts_what_runs(cli: Callable[..., CliResult], overrides: tuple[str, ...]) -> None:
    result = cli("check", *BASE, *overrides, "--format", "json")
    rules = {f["rule_id"] for f in json.loads(result.out)["findings"]}
    assert not rules & {"verl-group-estimator-n", "verl-load-format"}


ENGINES = {"vllm": VLLM.split("==")[1], "sglang": SGLANG.split("==")[1]}
"""The versions verl 0.9.1's extras pin (``verl[vllm]``, ``verl[sglang]``): the test reads them from verl's own
metadata; their wheels are the ones the engine-limit tests fetch (``engine_sources``)."""


@pytest.fixture(scope="session")
def engine_wheels(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Each engine's wheel, its Python files unpacked (read, never imported), shared with the engine-limit tests."""
    root = cache_root(request, tmp_path_factory)
    root.mkdir(parents=True, exist_ok=True)
    return {"vllm": unpacked_wheel(root, VLLM, "vllm"), "sglang": unpacked_wheel(root, SGLANG, "sglang")}


def test_the_engine_pins_are_verls_own() -> None:
    from importlib.metadata import requires

    pins = {r.split(";")[0].strip() for r in requires("verl") or []}
    assert {f"{name}=={version}" for name, version in ENGINES.items()} <= pins


@pytest.mark.slow  # downloads the engines' wheels once per machine (vLLM's is ~280 MB)
def test_shipped_engine_formats_are_what_the_engines_source_says(engine_wheels: dict[str, Path]) -> None:
    shipped = Path(__file__).parent.parent / "verl_safe_launch" / "data" / "engine_formats.json"
    made = engine_formats_json(engine_wheels["vllm"], engine_wheels["sglang"], "0.9.1")
    assert made == shipped.read_text(), "regenerate verl_safe_launch/data/engine_formats.json"
    assert "dummy_dtensor" not in json.loads(made)["vllm"]["load_formats"]

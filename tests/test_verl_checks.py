"""Rules run only where the release they judge makes the check, read from that release's own code."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.audit import AUDIT_RULES
from verl_safe_launch.inputs import PROBES, choose_verl, verl_checks, verl_release
from verl_safe_launch.inputs.verl_checks import find_checks
from verl_safe_launch.rules import RULES

TRAINER = """
class RayPPOTrainer:
    def _validate_config(self):
        config = self.config
        n_gpus = config.trainer.n_gpus_per_node * config.trainer.nnodes
        real_train_batch_size = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
        assert real_train_batch_size % n_gpus == 0
        {mini}assert config.data.train_batch_size >= config.actor_rollout_ref.actor.ppo_mini_batch_size
"""


@pytest.fixture(autouse=True)
def _installed() -> Iterator[None]:
    yield
    choose_verl(None)


def _package(root: Path, mini: str) -> Path:
    package = root / "verl"
    (package / "trainer" / "ppo").mkdir(parents=True)
    (package / "trainer" / "ppo" / "ray_trainer.py").write_text(TRAINER.format(mini=mini))
    return package


def test_an_assertion_commented_out_is_no_check(tmp_path: Path) -> None:
    live = find_checks(_package(tmp_path / "live", ""))
    gone = find_checks(_package(tmp_path / "fork", "# "))
    assert live["actor-mini-le-train"] == [
        "trainer/ppo/ray_trainer.py",
        8,
        "RayPPOTrainer._validate_config",
        [],
        [],
    ]
    assert gone["actor-mini-le-train"] is None
    assert live["train-batch-divisible"] is not None and gone["train-batch-divisible"] is not None


def test_every_check_a_rule_needs_is_found_in_the_installed_verl() -> None:
    """On the release the tool ships with, no rule goes unjudged for want of a check its probe cannot find."""
    needs = {n for rule in [*RULES, *AUDIT_RULES] for n in rule.needs if n.startswith("code:")}
    assert needs, "no rule reads its gate from verl's code"
    assert needs <= {f"code:{name}" for name in PROBES}
    found = verl_checks()
    assert sorted(n for n in needs if found[n.removeprefix("code:")] is None) == []


def test_the_loss_agg_modes_are_read_from_the_release() -> None:
    site = verl_checks()["loss-agg-mode"]
    assert site is not None and {"token-mean", "token-sum", "seq-mean-token-sum-norm"} <= set(site.strings)


@pytest.mark.slow
def test_per_gpu_micro_keys_follow_each_releases_workers(
    releases: Path, cli: Callable[..., CliResult]
) -> None:
    """0.8.0's engine workers assert the per-GPU actor micro batch; 0.7.1's legacy workers derive it from the
    deprecated key. No GPU here: the nearest boundary is the release's own source, whose assertion is found."""
    line = [
        "actor_rollout_ref.actor.ppo_micro_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=256",
        "actor_rollout_ref.rollout.name=vllm",
        "--format",
        "json",
    ]

    def actor_errors(version: str) -> list[str]:
        data = json.loads(cli("--verl", str(releases / version), "check", *line).out)
        assert data["verl"]["version"] == version
        return [f["message"] for f in data["findings"] if f["rule_id"] == "verl-actor-micro-keys"]

    [message] = actor_errors("0.8.0")
    assert message.endswith(
        "verl 0.8.0 accepts this, then stops with a bare AssertionError when the workers build the actor"
    )
    site = verl_checks()["per-gpu-micro-asserted"]
    assert site is not None and site.file == "workers/engine_workers.py"
    assert actor_errors("0.7.1") == []
    assert verl_checks()["deprecated-micro-converted"] is not None


@pytest.mark.slow
def test_a_rule_older_releases_lack_is_named_once_not_reported(releases: Path) -> None:
    choose_verl(releases / "0.5.0", "--verl")
    release = verl_release()
    assert release.has("code:loss-agg-mode") and not release.has("code:dynamic-bsz-equal")
    site = verl_checks()["loss-agg-mode"]
    assert site is not None and site.function == "RayPPOTrainer._validate_config"
    assert "token-sum" not in site.strings  # 0.5.0's own list: verl 0.9's longer one would be wrong here


FORK_TRAINER = """
class RayPPOTrainer:
    def __init__(self, config):
        self.config = config
        adapt = self.config.actor_rollout_ref.actor.adaptive_entropy
        if config.algorithm.use_kl_in_reward:
            self.kl = config.algorithm.kl_ctrl.kl_coef
        name = config.reward_model.get("reward_manager", "naive")
        config.trainer.written_here = 1
        print(config.trainer.written_here)
"""


def test_keys_a_trainer_reads_on_every_launch_are_read_from_its_source(tmp_path: Path) -> None:
    from verl_safe_launch.inputs.config_reads import find_reads

    package = tmp_path / "verl"
    (package / "trainer" / "ppo").mkdir(parents=True)
    (package / "trainer" / "ppo" / "ray_trainer.py").write_text(FORK_TRAINER)
    reads = [(key, line) for key, _, line, _ in find_reads(package)]
    # the body of an if runs on one path only; .get reads its node; a key the function writes is its own
    assert reads == [
        ("actor_rollout_ref.actor.adaptive_entropy", 5),
        ("algorithm.use_kl_in_reward", 6),
        ("reward_model", 8),
        ("trainer", 9),
    ]


def test_the_installed_verl_reads_only_keys_its_own_configs_have(cli: Callable[..., CliResult]) -> None:
    from verl_safe_launch.inputs import config_reads

    assert len(config_reads()) > 5
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        data = json.loads(cli("check", "--config-name", name, "--format", "json").out)
        assert not [f for f in data["findings"] if f["rule_id"] == "verl-config-read"]
    data = json.loads(cli("check", "~trainer.project_name", "--format", "json").out)
    read = [f["message"] for f in data["findings"] if f["rule_id"] == "verl-config-read"]
    assert read == [
        "verl 0.9.1 reads config.trainer.project_name in RayPPOTrainer.__init__ (trainer/ppo/ray_trainer.py:352) on "
        "every launch, and this config has no trainer.project_name: a ConfigAttributeError before training"
    ]


def test_a_reward_file_verl_imports_may_register_its_own_reward_manager(
    cli: Callable[..., CliResult],
) -> None:
    line = ["reward.reward_manager.name=mine", "--format", "json"]

    def registry_errors(*extra: str) -> list[str]:
        data = json.loads(cli("check", *line, *extra).out)
        return [f["rule_id"] for f in data["findings"] if f["rule_id"] == "verl-registry-name"]

    assert registry_errors() == ["verl-registry-name"]
    assert registry_errors("reward.custom_reward_function.path=recipe/mine/reward.py") == []


@pytest.mark.slow
def test_names_a_worker_compares_complete_a_registry_never_make_one(releases: Path) -> None:
    """0.7.1's legacy workers take rollout.name=hf (compared before its table's lookup); 0.5.0 has no table."""
    from verl_safe_launch.inputs import read_registries

    assert "hf" in read_registries(releases / "0.7.1")["rollout"]
    assert read_registries(releases / "0.5.0")["rollout"] == []

"""A script written for another verl says so once, and did-you-mean never crosses meanings.

The scripts are verl's own examples of older releases (tests/data/upgrade_corpus, with their sources), judged
against the installed verl; which release has which key is verl's own release history.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DATA, CliResult

from verl_safe_launch.audit import last_release_with
from verl_safe_launch.inputs import did_you_mean, is_typo, verl_release

LAUNCH = "python3 -m verl.trainer.main_ppo data.train_batch_size=64 trainer.n_gpus_per_node=8"


def _unknown(cli: Callable[..., CliResult], script: Path) -> list[dict[str, object]]:
    data = json.loads(cli("audit", str(script), "--format", "json").out)
    return [f for f in data["scripts"][0]["launches"][0]["findings"] if f["rule_id"] == "unknown-key"]


def test_keys_of_an_older_release_are_one_headline_with_the_two_ways_forward(
    cli: Callable[..., CliResult],
) -> None:
    script = DATA / "upgrade_corpus" / "v01_ppo_gae.sh"
    found = _unknown(cli, script)
    [headline] = [f for f in found if "was written for" in str(f["message"])]
    keys = headline["keys"]
    assert isinstance(keys, list) and len(keys) >= 2
    assert all(last_release_with(str(k)) is not None for k in keys if "." in str(k))  # keys of older releases
    assert not [f for f in found if f is not headline and set(f["keys"]) & set(keys)]  # each said once
    assert str(headline["message"]).startswith("this launch was written for verl 0.")
    assert f", not verl {verl_release().version}: " in str(headline["message"])
    fix = str(headline["fix"])
    assert (
        f"verl-safe-launch --verl DIR audit {script}" in fix
        and "pip install --no-deps --target DIR verl==0." in fix
    )
    assert f"verl-safe-launch upgrade {script} -o DIR" in fix
    assert len(headline["sources"]) == len(keys)  # every key listed under it, with its line


def test_keys_no_release_has_are_named_as_a_fork_or_the_projects_own(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        f"{LAUNCH} data.max_obs_length=500 retriever.topk=3 actor_rollout_ref.rollout.n_agent=5\n"
    )
    [headline] = _unknown(cli, script)
    assert "a newer verl, a fork or the project's own code" in str(headline["message"])
    assert headline["keys"] == ["data.max_obs_length", "retriever.topk", "actor_rollout_ref.rollout.n_agent"]
    assert "did you mean" not in str(headline["fix"])


def test_a_typo_keeps_its_own_finding_and_its_did_you_mean(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"{LAUNCH} data.train_bach_size=64\n")
    [finding] = _unknown(cli, script)
    assert finding["keys"] == ["data.train_bach_size"]
    assert str(finding["fix"]).startswith("did you mean data.train_batch_size?")


CROSSING = [
    ("data.max_obs_length", "data.max_prompt_length"),
    ("actor_rollout_ref.model.torch_dtype", "actor_rollout_ref.model.lora.dtype"),
    ("actor_rollout_ref.actor.fsdp_config.grad_offload", "actor_rollout_ref.actor.fsdp_config.param_offload"),
    ("trainer.val_only_before", "trainer.val_before_train"),
]


@pytest.mark.parametrize(("key", "other"), CROSSING)
def test_did_you_mean_never_crosses_meanings(key: str, other: str) -> None:
    """Keys a fork or an older release wrote, spelled like one of verl's that means something else."""
    import difflib

    keys = verl_release().config_keys
    assert other in keys and difflib.get_close_matches(key, list(keys), 1, 0.6)  # spelling alone would say it
    assert did_you_mean(key, verl_release().config_keys) is None
    assert not is_typo(key.rpartition(".")[2], other.rpartition(".")[2])


SAME = [
    ("data.train_bach_size", "data.train_batch_size"),
    ("data.trainbatch_size", "data.train_batch_size"),
    ("trainer.nnode", "trainer.nnodes"),
]


@pytest.mark.parametrize(("key", "meant"), SAME)
def test_did_you_mean_a_slip_of_the_keyboard(key: str, meant: str) -> None:
    assert did_you_mean(key, verl_release().config_keys) == meant


def test_keys_of_another_model_engine_are_not_another_verls(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """actor.megatron.* exist under model_engine=megatron: the engine mismatch explains them, not an older verl."""
    script = tmp_path / "run.sh"
    script.write_text(
        f"{LAUNCH} actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "
        "actor_rollout_ref.actor.megatron.param_offload=True\n"
    )
    found = _unknown(cli, script)
    assert [f["keys"] for f in found] == [
        ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"],
        ["actor_rollout_ref.actor.megatron.param_offload"],
    ]
    assert not any("was written for" in str(f["message"]) for f in found)


@pytest.mark.slow
def test_a_config_group_option_the_release_lacks_is_a_no_go_not_an_unreadable_script(
    releases: Path, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """model_engine=megatron under 0.7.1 (whose model_engine group has no megatron): its Hydra refuses it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    script = tmp_path / "run.sh"
    script.write_text(f"{LAUNCH} model_engine=megatron\n")
    result = cli("--verl", str(releases / "0.7.1"), "audit", str(script), "--format", "json")
    data = json.loads(result.out)
    assert (result.code, data["verdict"]) == (1, "no-go")
    [finding] = data["scripts"][0]["launches"][0]["findings"]
    assert (
        finding["keys"] == ["model_engine"] and "verl 0.7.1's Hydra refuses the launch" in finding["message"]
    )
    config = str(releases / "0.7.1" / "verl" / "trainer" / "config")
    with initialize_config_dir(config, version_base=None), pytest.raises(HydraException):
        hydra_compose("ppo_trainer", overrides=["model_engine=megatron"])

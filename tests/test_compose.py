"""Composition: equal to Hydra's own compose of verl's config, with provenance for every leaf."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from verl_safe_launch.compose import compose
from verl_safe_launch.errors import ConfigError, InputError, UsageError
from verl_safe_launch.inputs import ComposeRequest, cli_tokens, verl_config_dir
from verl_safe_launch.provenance import Layer


def _compose(*overrides: str, files: tuple[Path, ...] = ()) -> object:
    return compose(ComposeRequest(overrides=cli_tokens(list(overrides)), config_files=files))


def _hydra_compose(overrides: list[str]) -> dict[str, object]:
    """verl's config as Hydra's public compose API builds it (what verl's @hydra.main would see)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        cfg = hydra_compose("ppo_trainer", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _verl_line(relative: str, key: str) -> int:
    lines = (verl_config_dir() / relative).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(f"{key}:"))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["data.train_batch_size=60", "actor_rollout_ref.rollout.n=12"],
        ["model_engine=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
        ["+actor_rollout_ref.rollout.enable_sleep_mode=false", "++trainer.project_name=x", "++new_top=1"],
        [
            "~trainer.logger",
            "trainer.n_gpus_per_node=4",
            "data.train_batch_size=64",
            "data.train_batch_size=128",
        ],
        ["trainer.logger=[console,wandb]", "actor_rollout_ref.actor.optim={lr:2e-6}"],
    ],
)
def test_composed_config_equals_hydra_compose(overrides: list[str]) -> None:
    ours = _compose(*overrides)
    assert OmegaConf.to_container(ours.cfg, resolve=False) == _hydra_compose(overrides)  # type: ignore[attr-defined]


def test_compositions_in_one_process_do_not_leak_into_each_other(tmp_path: Path) -> None:
    """verl's defaults are composed once and reused: nothing a composition writes may reach the next one."""
    user = tmp_path / "run.yaml"
    user.write_text("trainer:\n  project_name: from_file\n")
    before = _compose().view  # type: ignore[attr-defined]
    _compose("model_engine=megatron", "+trainer.extra=1", "~trainer.logger", files=(user,))
    changed = _compose("data.train_batch_size=60", "+trainer.extra=2", files=(user,))
    assert changed.view.get("trainer.extra") == 2  # type: ignore[attr-defined]
    after = _compose()
    assert OmegaConf.to_container(after.cfg, resolve=False) == _hydra_compose([])  # type: ignore[attr-defined]
    assert dict(after.view.provenance) == dict(before.provenance)  # type: ignore[attr-defined]
    assert after.cfg is not _compose().cfg  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model_engine=megatron", "actor_rollout_ref.actor.use_dynamic_bsz=true"],
        ["data.max_prompt_length=77", "+trainer.copy=${data.max_prompt_length}", "+trainer.text=a${.copy}b"],
        ["trainer.logger=[console,'${trainer.project_name}']", "+trainer.home=${oc.env:HOME}"],
        [
            "critic.ppo_micro_batch_size=${oc.select:data.nope,3}",
            "critic.optim={lr:'${data.train_batch_size}'}",
        ],
    ],
)
def test_view_values_are_omegaconf_resolution(overrides: list[str]) -> None:
    composed = _compose(*overrides)
    resolved = OmegaConf.to_container(composed.cfg, resolve=True)  # type: ignore[attr-defined]
    for key, value in composed.view.values.items():  # type: ignore[attr-defined]
        expected: Any = resolved
        for part in key.split("."):
            expected = expected[part]
        assert (value, type(value)) == (expected, type(expected)), key


def test_every_engine_in_turn_equals_hydra_compose() -> None:
    """Each config-group choice is composed once per process; switching back and forth changes nothing."""
    for engine in ["megatron", "dp", "veomni", "megatron", "torchtitan", "dp"]:
        overrides = [f"model_engine={engine}", "data.train_batch_size=32"]
        ours = _compose(*overrides).cfg  # type: ignore[attr-defined]
        assert OmegaConf.to_container(ours, resolve=False) == _hydra_compose(overrides), engine


def test_cli_value_records_position_and_replaced_verl_default() -> None:
    view = _compose("data.train_batch_size=60", "actor_rollout_ref.rollout.n=12").view  # type: ignore[attr-defined]
    prov = view.prov("data.train_batch_size")
    assert prov.value == 60
    assert (prov.source.layer, prov.source.arg_index, prov.source.raw) == (
        Layer.CLI,
        1,
        "data.train_batch_size=60",
    )
    (old,) = prov.history
    assert old.value == 1024
    assert old.source.file == "verl/trainer/config/data/legacy_data.yaml"
    assert old.source.line == _verl_line("data/legacy_data.yaml", "train_batch_size")


def test_file_then_cli_keeps_both_in_order(tmp_path: Path) -> None:
    user = tmp_path / "run.yaml"
    user.write_text("data:\n  max_prompt_length: 256\n  train_batch_size: 32\n")
    view = _compose("data.train_batch_size=48", files=(user,)).view  # type: ignore[attr-defined]
    prov = view.prov("data.train_batch_size")
    assert [w.value for w in prov.history] == [1024, 32]
    assert (prov.history[1].source.file, prov.history[1].source.line) == (str(user), 3)
    assert prov.source.arg_index == 1 and prov.value == 48


def test_dotted_and_nested_yaml_keys(tmp_path: Path) -> None:
    user = tmp_path / "run.yaml"
    user.write_text(
        "actor_rollout_ref.rollout.n: 8\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 16\n"
    )
    view = _compose(files=(user,)).view  # type: ignore[attr-defined]
    assert view.get("actor_rollout_ref.rollout.n") == 8
    assert view.prov("actor_rollout_ref.rollout.n").source.line == 1
    assert view.get("actor_rollout_ref.actor.ppo_mini_batch_size") == 16
    assert view.prov("actor_rollout_ref.actor.ppo_mini_batch_size").source.line == 4


def test_interpolation_records_what_it_follows() -> None:
    view = _compose("actor_rollout_ref.actor.use_dynamic_bsz=true").view  # type: ignore[attr-defined]
    prov = view.prov("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz")
    assert prov.value is True
    assert prov.follows == "actor_rollout_ref.actor.use_dynamic_bsz"
    assert prov.interpolation is not None and "use_dynamic_bsz" in prov.interpolation
    relative = view.prov("critic.ppo_micro_batch_size_per_gpu")
    assert relative.follows == "critic.ppo_micro_batch_size"


def test_lists_are_leaves_and_deletion_is_recorded() -> None:
    view = _compose("trainer.logger=[console,wandb]").view  # type: ignore[attr-defined]
    assert view.get("trainer.logger") == ["console", "wandb"]
    deleted = _compose("~trainer.logger").view  # type: ignore[attr-defined]
    assert "trainer.logger" not in deleted


def test_group_override_switches_engine_and_records_megatron_file() -> None:
    view = _compose("model_engine=megatron").view  # type: ignore[attr-defined]
    prov = view.prov("actor_rollout_ref.actor.strategy")
    assert prov.value == "megatron"
    assert prov.source.file == "verl/trainer/config/actor/megatron_actor.yaml"


def test_every_leaf_has_provenance() -> None:
    view = _compose().view  # type: ignore[attr-defined]
    assert len(view.values) > 500
    assert set(view.values) == set(view.provenance)
    unattributed = [k for k, p in view.provenance.items() if p.source.file is None]
    assert unattributed == []


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            ["data.train_bach_size=60"],
            UsageError,
            "unknown key 'data.train_bach_size': verl's config has no such key",
        ),
        (
            ["+data.train_batch_size=60"],
            UsageError,
            "'data.train_batch_size' already exists, so '+' cannot add it",
        ),
        (["data.train_batch_size=[1,"], UsageError, "invalid override 'data.train_batch_size=[1,': "),
        (["preset=nope"], ConfigError, "unknown preset 'nope'"),
        (["model_engine=nope"], ConfigError, "cannot compose verl's config: "),
        (["hardware.gpus=8"], UsageError, "unknown hardware token 'hardware.gpus'"),
    ],
)
def test_override_errors(overrides: list[str], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        _compose(*overrides)
    assert str(info.value).startswith(message)


def test_unknown_key_error_names_position_and_suggestion() -> None:
    with pytest.raises(UsageError) as info:
        _compose("data.max_prompt_length=10", "data.train_bach_size=60")
    assert info.value.where == "command line, argument 2 (data.train_bach_size=60)"
    assert info.value.fix == "did you mean 'data.train_batch_size'?"


@pytest.mark.parametrize(
    ("text", "message", "where"),
    [
        ("data: [1, 2\n", "malformed YAML in {path}: ", "{path}:2:1"),
        ("data:\n  n: 1\n  n: 2\n", "duplicate key 'data.n' in {path} (lines 2 and 3)", "{path}:3"),
        ("- 1\n- 2\n", "{path} must contain a mapping of keys to values, not a list", "{path}:1"),
        ("just text\n", "{path} must contain a mapping of keys to values, not a single value", "{path}:1"),
    ],
)
def test_user_file_errors(tmp_path: Path, text: str, message: str, where: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        _compose(files=(path,))
    assert str(info.value).startswith(message.format(path=path))
    assert info.value.where == where.format(path=path)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^file not found: .*nope\.yaml$"):
        _compose(files=(tmp_path / "nope.yaml",))
    with pytest.raises(InputError, match=r" is a directory, not a regular file$"):
        _compose(files=(tmp_path,))


def test_yaml_types_match_omegaconf() -> None:
    from verl_safe_launch.inputs import parse_yaml

    doc = parse_yaml("lr: 1e-6\nwhen: 2024-01-01\nflag: true\nnone: null\n", "x.yaml", expand_dots=True)
    assert doc.data == {"lr": 1e-6, "when": "2024-01-01", "flag": True, "none": None}


def test_a_refused_group_choice_is_refused_again_without_composing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder's scripts naming the same missing config file get Hydra's same refusal, composed once."""
    from verl_safe_launch.compose import _hydra

    calls: list[object] = []
    real = _hydra.compose_defaults

    def counted(overrides: Any, *rest: Any) -> Any:
        calls.append(overrides)
        return real(overrides, *rest)

    monkeypatch.setattr(_hydra, "compose_defaults", counted)
    errors = []
    for _ in range(2):
        with pytest.raises(ConfigError) as info:
            _compose("model_engine=missing_twice", "data.train_batch_size=60")
        errors.append((str(info.value), info.value.where, info.value.fix))
    assert len(calls) == 1
    assert errors[0] == errors[1]
    assert "Could not find 'model_engine/missing_twice'" in errors[0][0]
    assert errors[0][1] == "command line, argument 1 (model_engine=missing_twice)"

"""How verl 0.9.1 reads a value (verl_safe_launch/audit/readings.py), each entry checked by running or reading
the verl code it cites: values read alike are not advice, keys a run does not read are not advice, values verl
refuses once the run has started are never advice."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from conftest import make_tiny_model

from verl_safe_launch.audit import (
    ALIKE,
    FALLBACK,
    NOT_READ,
    equivalent_values,
    runtime_refusal,
    unread_because,
)
from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens

ARR = "actor_rollout_ref"
pytestmark = pytest.mark.filterwarnings(
    "ignore:.* engine is not available:UserWarning"
)  # verl's optional engines


def _view(*overrides: str) -> Any:
    return compose(ComposeRequest(overrides=cli_tokens(list(overrides)))).view


def _learning_rates(min_lr_ratio: float | None, kind: str) -> list[float]:
    """The learning rates verl 0.9.1's FSDP engine schedules for 20 steps with this min_lr_ratio."""
    import torch
    from verl.workers.config.optimizer import FSDPOptimizerConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    engine = object.__new__(FSDPEngine)
    engine.optimizer_config = FSDPOptimizerConfig(
        lr=1e-3, min_lr_ratio=min_lr_ratio, lr_scheduler_type=kind, total_training_steps=20, lr_warmup_steps=2
    )
    engine.rank = 0
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = engine._build_lr_scheduler(optimizer)
    rates = []
    for _ in range(20):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.slow  # imports verl's FSDP engine
@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_a_null_min_lr_ratio_schedules_as_zero(kind: str) -> None:
    assert _learning_rates(None, kind) == _learning_rates(0.0, kind)
    assert equivalent_values(f"{ARR}.actor.optim.min_lr_ratio", None, 0.0, _view())
    assert _learning_rates(0.1, "cosine") != _learning_rates(0.0, "cosine")


def _load_checkpoint(tmp_path: Path, **trainer: object) -> object:
    """verl 0.9.1's legacy trainer looking for a checkpoint to resume from (an empty checkpoint folder)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    settings = {
        "resume_mode": "auto",
        "default_hdfs_dir": None,
        "default_local_dir": str(tmp_path),
        **trainer,
    }
    fake = object.__new__(RayPPOTrainer)
    fake.config = OmegaConf.create({"trainer": settings})
    try:
        return fake._load_checkpoint()
    except (AssertionError, NotImplementedError) as exc:
        return type(exc).__name__


@pytest.mark.slow  # imports verl's trainer (Ray)
@pytest.mark.parametrize("mode", ["auto", "disable", "resume_path"])
def test_resume_from_path_false_and_null_resume_alike(mode: str, tmp_path: Path) -> None:
    old = _load_checkpoint(tmp_path, resume_mode=mode, resume_from_path=False)
    assert old == _load_checkpoint(tmp_path, resume_mode=mode, resume_from_path=None)
    assert equivalent_values("trainer.resume_from_path", False, None, _view())
    if mode != "resume_path":
        assert unread_because("trainer.resume_from_path", _view(f"trainer.resume_mode={mode}")) is not None


@pytest.mark.slow  # imports verl's trainer (Ray)
def test_an_hdfs_checkpoint_dir_stops_the_run_when_it_looks_for_a_checkpoint(tmp_path: Path) -> None:
    assert _load_checkpoint(tmp_path, default_hdfs_dir="hdfs://tmp/x") == "NotImplementedError"
    assert _load_checkpoint(tmp_path, default_hdfs_dir="hdfs://tmp/x", resume_mode="disable") == 0
    assert runtime_refusal("trainer.default_hdfs_dir", "hdfs://tmp/x", _view()) is not None
    view = _view("trainer.resume_mode=disable")
    assert runtime_refusal("trainer.default_hdfs_dir", "hdfs://tmp/x", view) is None


@pytest.mark.slow  # imports verl's model config (transformers)
def test_a_null_tokenizer_or_config_path_is_the_models_path(tmp_path: Path) -> None:
    from verl.workers.config.model import HFModelConfig

    model = str(make_tiny_model(tmp_path / "m"))
    config = HFModelConfig(path=model, tokenizer_path=None, hf_config_path=None)
    assert config.tokenizer_path == model and config.hf_config_path == model
    view = _view(f"critic.model.path={model}")
    for key in FALLBACK:
        if key.startswith("critic."):
            assert equivalent_values(key, None, model, view)
            assert not equivalent_values(key, None, model + "-other", view)


def test_old_releases_gave_vllm_dummy_for_every_dummy_format(releases: Path) -> None:
    """verl 0.5.0's vLLM rollout: ``load_format = "dummy" if config.load_format.startswith("dummy") else ...``."""
    source = releases / "0.5.0" / "verl" / "workers" / "rollout" / "vllm_rollout" / "vllm_rollout_spmd.py"
    found = [
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.IfExp)
        and isinstance(node.body, ast.Constant)
        and node.body.value == "dummy"
        and "startswith" in ast.unparse(node.test)
        and "'dummy'" in ast.unparse(node.test)
    ]
    assert found
    entry = next(e for e in ALIKE if e.pattern.endswith("rollout.load_format"))
    assert all(str(v).startswith("dummy") for v in entry.values)
    assert equivalent_values(f"{ARR}.rollout.load_format", "dummy_dtensor", "dummy", _view())


def test_keys_verl_never_reads_are_only_stored() -> None:
    """No code of the installed verl loads the attribute a NOT_READ key is stored in."""
    import verl

    root = Path(verl.__file__).parent
    for key in NOT_READ:
        leaf = key.rsplit(".", 1)[1]
        loads = [
            path
            for path in root.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8", errors="replace")))
            if isinstance(node, ast.Attribute) and node.attr == leaf and isinstance(node.ctx, ast.Load)
        ]
        assert loads == [], (key, loads)
        assert unread_because(key, _view()) == NOT_READ[key]


@pytest.mark.parametrize(
    ("key", "value", "overrides", "refused"),
    [
        (f"{ARR}.rollout.load_format", "dummy_dtensor", (f"{ARR}.rollout.name=vllm",), True),
        (f"{ARR}.rollout.load_format", "dummy", (f"{ARR}.rollout.name=vllm",), False),
        (f"{ARR}.rollout.load_format", "layered", (f"{ARR}.rollout.name=sglang",), False),
        ("algorithm.adv_estimator", "gigpo", (), True),
        ("algorithm.adv_estimator", "grpo", (), False),
        ("reward.reward_manager.name", "naive", (), False),
    ],
)
def test_values_verl_or_its_engine_refuse_at_run_time(
    key: str, value: str, overrides: tuple[str, ...], refused: bool
) -> None:
    assert (runtime_refusal(key, value, _view(*overrides)) is not None) is refused


@pytest.mark.parametrize(
    ("key", "overrides", "read"),
    [
        ("critic.optim.lr", ("algorithm.adv_estimator=grpo",), False),
        ("critic.optim.lr", ("algorithm.adv_estimator=gae",), True),
        (f"{ARR}.ref.fsdp_config.param_offload", (f"{ARR}.actor.use_kl_loss=false",), False),
        (f"{ARR}.ref.fsdp_config.param_offload", (f"{ARR}.actor.use_kl_loss=true",), True),
        ("data.val_batch_size", ("data.val_batch_size=8",), False),
        ("algorithm.filter_groups.metric", (), False),
        (f"{ARR}.rollout.max_num_seqs", (), True),
    ],
)
def test_keys_the_run_reads(key: str, overrides: tuple[str, ...], read: bool) -> None:
    assert (unread_because(key, _view(*overrides)) is None) is read

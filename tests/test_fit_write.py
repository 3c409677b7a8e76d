"""``check --fit --write FILE``: the fitted config written as one YAML file that ``check -c FILE`` reads back as
the same config, with the micro batches --fit filled; never over an existing file without --force, never over
an input, never for a NO-GO config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLES, CliResult

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens

Cli = Callable[..., CliResult]
HARDWARE = ["hardware.nodes=1", "hardware.gpus_per_node=6", "hardware.gpu_memory_gb=80"]
MICRO = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
)


@pytest.fixture
def unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The 6-GPU example with its micro batches left unset (verl stops on them): what --fit fills."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    lines = (EXAMPLES / "grpo_6gpu.yaml").read_text().splitlines()
    text = (
        "\n".join(line for line in lines if "micro_batch_size_per_gpu" not in line and line != "  ref:")
        + "\n"
    )
    (tmp_path / "run.yaml").write_text(text)
    return tmp_path / "run.yaml"


def test_the_written_file_is_the_fitted_config(unset: Path, cli: Cli) -> None:
    before = json.loads(cli("check", "-c", str(unset), *HARDWARE, "--format", "json").out)
    assert before["verdict"] == "no-go", "unset micro batches stop verl"
    result = cli("check", "--fit", "--write", "fitted.yaml", "-c", str(unset), *HARDWARE, "--format", "json")
    assert result.code == 0, result.out + result.err
    written = json.loads(result.out)["written"]
    assert written["path"] == "fitted.yaml" and set(written["fitted"]) == set(MICRO)
    data = yaml.safe_load(Path("fitted.yaml").read_text())
    fitted: dict[str, object] = {}
    for key in MICRO:
        node: object = data
        for part in key.split("."):
            assert isinstance(node, dict)
            node = node[part]
        fitted[key] = node
        assert isinstance(node, int) and node >= 1, (key, node)
    again = compose(ComposeRequest(overrides=cli_tokens(HARDWARE), config_files=(Path("fitted.yaml"),)))
    assert {key: again.view.get(key) for key in MICRO} == fitted
    checked = cli(*written["check"].split()[1:], "--format", "json")
    assert json.loads(checked.out)["verdict"] == "go", "the file alone, without --fit, is GO"
    text = cli("check", "--fit", "--write", "other.yaml", "-c", str(unset), *HARDWARE)
    assert (
        "wrote other.yaml: " in text.out
        and f"check it with: {written['check']}".replace("fitted.yaml", "other.yaml") in text.out
    )


def test_write_refuses_what_it_must_not_touch(unset: Path, cli: Cli) -> None:
    Path("taken.yaml").write_text("keep: me\n")
    refused = cli("check", "--fit", "--write", "taken.yaml", "-c", str(unset), *HARDWARE)
    assert refused.code == 2 and "taken.yaml already exists" in refused.err
    assert Path("taken.yaml").read_text() == "keep: me\n"
    assert cli("check", "--fit", "--write", "taken.yaml", "--force", "-c", str(unset), *HARDWARE).code == 0
    assert "ppo_micro_batch_size_per_gpu" in Path("taken.yaml").read_text()
    own = cli("check", "--fit", "--write", str(unset), "--force", "-c", str(unset), *HARDWARE)
    assert own.code == 2 and "is an input of this command" in own.err
    assert cli("check", "--write", "new.yaml", "-c", str(unset), *HARDWARE).code == 2
    assert not Path("new.yaml").exists()


def test_a_no_go_config_is_not_written(unset: Path, cli: Cli) -> None:
    broken = cli(
        "check",
        "--fit",
        "--write",
        "fitted.yaml",
        "-c",
        str(unset),
        *HARDWARE,
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    )
    assert broken.code == 1 and "fitted.yaml not written: the config is NO-GO" in broken.err
    assert not Path("fitted.yaml").exists()

"""Which vLLM rollout modules of a verl copy hand the engine ``rollout.max_model_len``: read from the copy's own
source. verl 0.2 and its forks pick their module by the installed vLLM's version, and only one of the two reads the
key, so a length over the model's limit fails on one vLLM and not on the other: a warning there, not an error."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from conftest import CliResult

from verl_safe_launch.inputs import read_max_model_len_paths

ARR = "actor_rollout_ref"
BASE = (
    f"{ARR}.model.path=Qwen/Qwen2.5-0.5B-Instruct",  # max_position_embeddings 32768
    f"{ARR}.rollout.name=vllm",
    f"{ARR}.rollout.max_model_len=65536",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=2",
    f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=2",
)
READS = "llm = LLM(model=path, max_model_len=self.config.max_model_len)\n"
DERIVES = "llm = LLM(model=path, max_model_len=config.prompt_length + config.response_length)\n"


def _installed() -> Path:
    import verl

    return Path(verl.__file__).parent


def _copy(folder: Path, modules: dict[str, str]) -> Path:
    """A verl copy with the installed release's config files and the given vLLM rollout modules."""
    package = folder / "verl"
    shutil.copytree(_installed() / "trainer" / "config", package / "trainer" / "config")
    shutil.copytree(_installed() / "version", package / "version")
    (package / "__init__.py").write_text("")
    rollout = package / "workers" / "rollout" / "vllm_rollout"
    rollout.mkdir(parents=True)
    for name, text in modules.items():
        (rollout / name).write_text(text)
    return folder


def test_the_installed_verl_hands_every_engine_it_builds_the_key() -> None:
    found = read_max_model_len_paths(_installed().parent)
    assert "vllm_async_server.py" in found and all(found.values()), found


def test_a_module_that_derives_the_length_is_told_apart(tmp_path: Path) -> None:
    copy = _copy(tmp_path, {"vllm_rollout.py": READS, "vllm_rollout_spmd.py": DERIVES, "utils.py": "x = 1\n"})
    assert read_max_model_len_paths(copy) == {"vllm_rollout.py": True, "vllm_rollout_spmd.py": False}


def _finding(cli: Callable[..., CliResult], *verl: str) -> list[dict[str, object]]:
    result = cli("check", *verl, *BASE, "--format", "json")
    return [f for f in json.loads(result.out)["findings"] if f["rule_id"] == "layout-rollout-max-model-len"]


def test_the_rule_follows_what_the_copy_hands_vllm(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    [installed] = _finding(cli)
    assert installed["severity"] == "error"
    split = _copy(tmp_path / "split", {"vllm_rollout.py": READS, "vllm_rollout_spmd.py": DERIVES})
    [either] = _finding(cli, "--verl", str(split))
    assert either["severity"] == "warning"
    assert "depends on the vLLM version installed" in str(either["message"])
    derived = _copy(tmp_path / "derived", {"vllm_rollout_spmd.py": DERIVES})
    assert _finding(cli, "--verl", str(derived)) == []

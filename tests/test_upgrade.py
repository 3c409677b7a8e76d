"""upgrade: launches written for older verl releases, rewritten for the installed verl and checked against it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.audit import (
    HAND_MOVES,
    RELEASES,
    detect_release,
    generate_moves,
    generated_moves,
    history,
    moves_json,
    plan_upgrade,
    version,
)
from verl_safe_launch.cli import main
from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import run_preflight

SCRIPT = Path(__file__).parent.parent / "launch_examples" / "grpo_v05.sh"
TAGS = ("v0.4.1", "v0.5.0", "v0.6.0", "v0.6.1", "v0.7.0", "v0.7.1", "v0.8.0", "v0.9.0")


@pytest.fixture(scope="module")
def installed() -> dict[str, object]:
    view = compose(ComposeRequest()).view
    return {key: view.get(key) for key in view.keys()}  # noqa: SIM118 (a view, not a dict)


def test_shipped_move_table_is_what_the_history_generates() -> None:
    text = (Path(__file__).parent.parent / "verl_safe_launch" / "data" / "verl_renames.json").read_text()
    assert moves_json(generate_moves()) == text


@pytest.mark.parametrize("move", [*generated_moves(), *HAND_MOVES], ids=lambda m: m.old)
def test_every_move_is_backed_by_the_history_and_the_installed_verl(
    move: object, installed: dict[str, object]
) -> None:
    from verl_safe_launch.audit import Move, current_key, moves_after

    assert isinstance(move, Move)
    release = version(move.release)
    older = [t for t in TAGS if version(t) < release and move.old in history(t)]
    assert older, f"{move.old} is in no release before {move.release}"
    newer = [t for t in TAGS if version(t) >= release and move.new in history(t)]
    assert newer, f"{move.new} is in no release from {move.release} on"
    final = current_key(move.old, moves_after(older[-1]), installed)
    assert final in installed, f"{move.old} -> {final}, which the installed verl lacks"


def _upgrade(tmp_path: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["upgrade", *args, "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_05_script_upgrades_to_a_config_the_installed_verl_composes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _upgrade(tmp_path, str(SCRIPT), capsys=capsys)
    assert code == 0
    assert "written for verl 0.5" in out
    yaml_file = tmp_path / "out" / "grpo_v05.yaml"
    composed = compose(ComposeRequest(config_files=(yaml_file,), lenient=True))
    assert composed.rejected == ()
    view = composed.view
    assert view.get("ray_kwargs.ray_init.num_cpus") == 64
    assert view.get("critic.fsdp.param_offload") is True
    assert view.get("global_profiler.steps") == [1, 2]
    assert view.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") == 2  # 16 / 8 GPUs
    assert view.get("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu") == 4
    assert view.get("actor_rollout_ref.rollout.name") == "vllm"
    assert view.get("actor_rollout_ref.actor.ppo_micro_batch_size") is None
    assert "trainer.use_legacy_worker_impl (line 24): dropped" in out
    assert "global micro batch 16 / 8 GPUs = 2 per GPU" in out
    assert "keep the old behaviour: actor_rollout_ref.rollout.max_num_seqs=1024" in out
    assert "keep the old behaviour: trainer.use_v1=false" in out
    assert "num_cpus: 64  # grpo_v05.sh:22 (upgraded from ray_init.num_cpus" in yaml_file.read_text()
    findings = run_preflight(compose(ComposeRequest(config_files=(yaml_file,), lenient=True))).findings
    assert [f for f in findings if f.rule_id in ("unknown-key", "deprecated-alias")] == []


def test_the_original_script_is_refused_where_the_upgrade_is_not(installed: dict[str, object]) -> None:
    tokens = cli_tokens(["ray_init.num_cpus=8", "critic.model.fsdp_config.param_offload=true"])
    findings = run_preflight(compose(ComposeRequest(overrides=tokens, lenient=True))).findings
    unknown = {f.keys[0]: f for f in findings if f.rule_id == "unknown-key"}
    assert "it is a key of verl 0.5.0" in unknown["ray_init.num_cpus"].message
    assert (unknown["ray_init.num_cpus"].fix or "").startswith("ray_kwargs.ray_init.num_cpus=8")
    assert "it is a key of verl 0.7.1" in unknown["critic.model.fsdp_config.param_offload"].message
    assert (unknown["critic.model.fsdp_config.param_offload"].fix or "").startswith(
        "critic.fsdp.param_offload=true"
    )


@pytest.mark.parametrize("series", [s for s in RELEASES if s != "0.9"])
def test_every_moved_key_of_an_older_release_lands_with_its_value(
    series: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], installed: dict[str, object]
) -> None:
    """A YAML in the style of each older release, written from its history: every key that moved since, set to
    a plain value; upgraded, it composes under the installed verl with each value under the key's new name."""
    from verl_safe_launch.audit import current_key, moves_after

    old = history(RELEASES[series])
    moves = moves_after(series)
    chosen = {
        k: v
        for k, v in old.items()
        if current_key(k, moves, installed) != k
        and not k.endswith("._target_")
        and isinstance(v, bool | int | float | str)
        and not (isinstance(v, str) and ("${" in v or v == "???"))
        and not k.startswith(("reward_model.", "custom_reward_function."))
    }
    if not chosen:
        pytest.skip(f"no key of verl {series} has moved since")
    source = tmp_path / f"run_v{series}.yaml"
    source.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in chosen.items()))
    code = main(["upgrade", str(source), "--from", series, "-o", str(tmp_path / "out")])
    capsys.readouterr()
    assert code == 0
    composed = compose(ComposeRequest(config_files=(tmp_path / "out" / source.name,), lenient=True))
    assert composed.rejected == ()
    for key, value in chosen.items():
        assert composed.view.get(current_key(key, moves, installed)) == value, key


def test_release_detection() -> None:
    installed = {"data.train_batch_size": 1024}
    assert detect_release(["data.train_batch_size"], installed)[0] == "0.9"
    series, why = detect_release(["ray_init.num_cpus", "trainer.profile_steps"], installed)
    assert series == "0.5"
    assert "2 of 2 keys are known to verl 0.5" in why
    assert (
        detect_release(["critic.model.fsdp_config.param_offload", "reward.reward_model.enable"], installed)[0]
        == "0.7"
    )


def test_a_global_micro_batch_that_does_not_split_is_refused_not_guessed(
    installed: dict[str, object],
) -> None:
    tokens = cli_tokens(["actor_rollout_ref.actor.ppo_micro_batch_size=12", "trainer.n_gpus_per_node=8"])
    upgrade = plan_upgrade(tokens, "0.5", "--from 0.5", installed)
    refused = [c for c in upgrade.changes if c.kind == "refused"]
    assert refused and "does not split over 8 GPUs" in refused[0].detail
    assert upgrade.tokens[0].text == "actor_rollout_ref.actor.ppo_micro_batch_size=12"


def test_output_is_never_overwritten_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _upgrade(tmp_path, str(SCRIPT), capsys=capsys)[0] == 0
    code, _, err = _upgrade(tmp_path, str(SCRIPT), capsys=capsys)
    assert code == 2
    assert "already exists" in err and "--force" in err
    assert _upgrade(tmp_path, str(SCRIPT), "--force", capsys=capsys)[0] == 0
    (tmp_path / "file").write_text("x")
    assert main(["upgrade", str(SCRIPT), "-o", str(tmp_path / "file")]) == 2


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["upgrade", str(SCRIPT), "--format", "json", "-o", str(tmp_path / "out")])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["schema"] == 1 and data["source_release"] == "0.5"
    kinds = {c["kind"] for c in data["changes"]}
    assert {"moved", "converted", "removed", "added", "default"} <= kinds


def test_non_finite_floats_of_a_yaml_stay_floats(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    import math

    import yaml

    old = tmp_path / "old.yaml"
    old.write_text(
        "actor_rollout_ref:\n  actor:\n    clip_ratio_c: .nan\n    clip_ratio_high: -.inf\n    grad_clip: .inf\n"
    )
    result = cli("upgrade", str(old), "-o", str(tmp_path / "out"))
    assert result.code == 0, result.err
    actor = yaml.safe_load((tmp_path / "out" / "old.yaml").read_text())["actor_rollout_ref"]["actor"]
    assert math.isnan(actor["clip_ratio_c"])
    assert (actor["clip_ratio_high"], actor["grad_clip"]) == (-math.inf, math.inf)

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
    TAGS,
    Upgrade,
    detect,
    evidence_of,
    flatten_release_yaml,
    generate_moves,
    generated_moves,
    history,
    history_json,
    moves_json,
    plan_upgrade,
    version,
)
from verl_safe_launch.cli import main
from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import run_preflight

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "launch_examples" / "grpo_v05.sh"
ARR = "actor_rollout_ref"
RELEASE_YAML = Path(__file__).parent / "data" / "verl_yaml"


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


@pytest.mark.slow  # upgrade checks its advice with verl's validate_config
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
    assert "global micro batch 16 / 8 GPUs = 2 per GPU (8 GPUs: trainer.n_gpus_per_node=8 (line 26)" in out
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


@pytest.mark.slow  # upgrade checks its advice with verl's validate_config
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
        and not current_key(k, moves, installed).endswith(
            "_per_gpu"
        )  # converted with arithmetic, tested above
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


@pytest.mark.parametrize("yaml_file", sorted(RELEASE_YAML.glob("*.ppo_trainer.yaml")), ids=lambda p: p.name)
def test_the_oldest_releases_history_is_generated_from_their_own_yaml(yaml_file: Path) -> None:
    """v0.1 … v0.3 are flattened from the ppo_trainer.yaml of the wheels on the package index (kept in tests/data)."""
    tag = yaml_file.name.split(".ppo_trainer")[0]
    shipped = Path(__file__).parent.parent / "verl_safe_launch" / "data" / "verl_history" / f"{tag}.json"
    assert history_json(flatten_release_yaml(yaml_file.read_text())) == shipped.read_text()
    assert tag in TAGS


DETECTIONS = [
    # (overrides, oldest, newest, weak)
    (["ray_init.num_cpus=8", "trainer.profile_steps=[1]"], "0.4", "0.5", False),
    (
        [
            "critic.model.fsdp_config.param_offload=true",
            "reward.reward_model.enable=true",
            f"{ARR}.rollout.name=vllm",
        ],
        "0.7",
        "0.7",
        False,
    ),
    # a key a release lacks: '+' on a key it has fails there, so the launch is older than trainer.val_before_train
    (["+trainer.val_before_train=false", "custom_reward_function.path=r.py"], "0.3", "0.3", False),
    # nothing sets the rollout engine, which is mandatory from 0.6 on
    (["actor_rollout_ref.actor.fsdp_config.grad_offload=true"], "0.1", "0.2", False),
    (["trainer.remove_previous_ckpt_in_save=true"], "0.2", "0.2", False),
    # keys every release has say nothing about age
    (["data.train_batch_size=8", "actor_rollout_ref.rollout.name=vllm"], "0.1", "0.9", True),
    (["data.train_batch_size=8"], "0.1", "0.5", True),
    # the project's own keys are no evidence
    (["env.rollout.n=8", "trainer.remove_previous_ckpt_in_save=true"], "0.2", "0.2", False),
]


@pytest.mark.parametrize(("overrides", "oldest", "newest", "weak"), DETECTIONS)
def test_release_detection_from_what_a_release_has_and_lacks(
    overrides: list[str], oldest: str, newest: str, weak: bool, installed: dict[str, object]
) -> None:
    found = detect(evidence_of(overrides), installed)
    assert (found.oldest, found.newest, found.weak) == (oldest, newest, weak), found.why
    if not weak:
        assert found.series == oldest


def test_weak_evidence_asks_for_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "run.yaml"
    source.write_text("data:\n  train_batch_size: 8\n")
    code, out, err = _upgrade(tmp_path, str(source), capsys=capsys)
    assert code == 2 and out == ""
    assert "cannot tell which verl release" in err and "fit verl 0.1 to 0.5" in err and "--from" in err
    assert not (tmp_path / "out" / "run.yaml").exists()


def test_a_global_micro_batch_that_does_not_split_is_refused_not_guessed(
    installed: dict[str, object],
) -> None:
    tokens = cli_tokens(["actor_rollout_ref.actor.ppo_micro_batch_size=12", "trainer.n_gpus_per_node=8"])
    upgrade = plan_upgrade(tokens, "0.5", "--from 0.5", installed)
    refused = [c for c in upgrade.changes if c.kind == "refused"]
    assert refused and "does not split over 8 GPUs" in refused[0].detail
    assert upgrade.tokens[0].text == "actor_rollout_ref.actor.ppo_micro_batch_size=12"


@pytest.mark.slow  # upgrade checks its advice with verl's validate_config
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


@pytest.mark.slow  # upgrade checks its advice with verl's validate_config
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


def _plan(
    overrides: list[str], installed: dict[str, object], source: str = "0.3", gpus: int | None = None
) -> Upgrade:
    from verl_safe_launch.audit import read_layout

    tokens = cli_tokens(overrides)
    layout = read_layout(tokens, history(RELEASES[source]), {}, gpus)
    return plan_upgrade(tokens, source, f"--from {source}", installed, layout)


def _texts(upgrade: Upgrade) -> list[str]:
    """The upgraded overrides, less the rollout engine every launch older than 0.6 gets."""
    return [t.text for t in upgrade.tokens if not t.text.startswith(f"{ARR}.rollout.name=")]


ULYSSES = [
    # (GPUs per node, nodes, actor SP, global micro, per GPU): the divisor is GPUs / SP, the data-parallel ranks
    (8, 1, 2, 16, 4),
    (8, 4, 2, 16, 1),
    (8, 4, 16, 16, 8),
    (8, 1, 1, 16, 2),
]


@pytest.mark.parametrize(("per_node", "nodes", "sp", "micro", "per_gpu"), ULYSSES)
def test_a_global_micro_batch_is_divided_by_the_data_parallel_ranks(
    per_node: int, nodes: int, sp: int, micro: int, per_gpu: int, installed: dict[str, object]
) -> None:
    upgrade = _plan(
        [
            f"trainer.n_gpus_per_node={per_node}",
            f"trainer.nnodes={nodes}",
            f"{ARR}.actor.ulysses_sequence_parallel_size={sp}",
            f"{ARR}.actor.ppo_micro_batch_size={micro}",
            f"{ARR}.ref.log_prob_micro_batch_size={micro}",
        ],
        installed,
    )
    texts = _texts(upgrade)
    assert f"{ARR}.actor.ppo_micro_batch_size_per_gpu={per_gpu}" in texts
    assert f"{ARR}.ref.log_prob_micro_batch_size_per_gpu={per_gpu}" in texts
    assert f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size={sp}" in texts
    if sp > 1:  # the reference model ran with the actor's SP; it keeps it
        assert f"{ARR}.ref.fsdp_config.ulysses_sequence_parallel_size={sp}" in texts
        assert f"{per_node * nodes} GPUs / Ulysses SP {sp}" in " ".join(c.detail for c in upgrade.changes)


def test_an_unreadable_gpu_count_is_never_assumed(installed: dict[str, object]) -> None:
    from verl_safe_launch.audit import read_layout

    tokens = cli_tokens([f"{ARR}.actor.ppo_micro_batch_size=16"])
    unreadable = {
        "trainer.n_gpus_per_node": "line 5 ($GPUS) depends on the command substitution $(nvidia-smi)"
    }
    layout = read_layout(tokens, history(RELEASES["0.3"]), unreadable, None)
    refused = plan_upgrade(tokens, "0.3", "--from 0.3", installed, layout)
    assert _texts(refused) == [f"{ARR}.actor.ppo_micro_batch_size=16"]
    assert "pass --gpus N" in refused.changes[0].detail and "nvidia-smi" in refused.changes[0].detail
    given = plan_upgrade(tokens, "0.3", "--from 0.3", installed, read_layout(tokens, {}, unreadable, 4))
    assert _texts(given) == [f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4"]
    assert "--gpus 4" in given.changes[0].detail


def test_plus_on_a_key_verl_has_becomes_a_plain_override(installed: dict[str, object]) -> None:
    upgrade = _plan(["+trainer.val_only=true", "+trainer.val_before_train=true", "+env.seed=1"], installed)
    assert _texts(upgrade) == ["trainer.val_only=true", "trainer.val_before_train=true", "+env.seed=1"]
    composed = compose(ComposeRequest(overrides=upgrade.tokens, lenient=True))
    assert composed.rejected == () and composed.view.get("trainer.val_only") is True


def test_legacy_reward_keys_move_to_where_verl_reads_them(installed: dict[str, object]) -> None:
    upgrade = _plan(
        ["reward_model.reward_manager=prime", "custom_reward_function.path=r.py", "reward_model.enable=true"],
        installed,
        source="0.9",
    )
    assert _texts(upgrade) == [
        "reward.reward_manager.name=prime",
        "reward.custom_reward_function.path=r.py",
        "reward.reward_model.enable=true",
    ]


def test_remove_previous_ckpt_in_save_keeps_its_meaning(installed: dict[str, object]) -> None:
    upgrade = _plan(["trainer.remove_previous_ckpt_in_save=True"], installed, source="0.2")
    assert _texts(upgrade) == ["trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1"]
    gone = _plan(["actor_rollout_ref.actor.fsdp_config.grad_offload=true"], installed, source="0.2")
    assert _texts(gone) == []
    assert "removed in verl 0.3 (the release history has it up to 0.2)" in gone.changes[0].detail


def test_project_keys_are_listed_and_a_group_estimator_without_a_group_is_refused(
    installed: dict[str, object],
) -> None:
    from verl_safe_launch.audit import lone_group, project_keys
    from verl_safe_launch.inputs import group_estimators

    upgrade = _plan(["algorithm.adv_estimator=grpo", "+env.rollout.n=8", "trainer.nnodes=1"], installed)
    project = project_keys(upgrade.tokens, installed)
    assert [k for k, _, _ in project] == ["env.rollout.n"]
    composed = compose(ComposeRequest(overrides=upgrade.tokens, lenient=True))
    refused = lone_group(composed.view, project)
    assert len(refused) == 1 and "grpo without a group is not grpo" in refused[0].detail
    assert "env.rollout.n=8" in refused[0].detail
    grouped = compose(
        ComposeRequest(overrides=cli_tokens(["algorithm.adv_estimator=grpo", f"{ARR}.rollout.n=8"]))
    )
    assert lone_group(grouped.view, project) == []
    assert "grpo" in group_estimators() and "gae" not in group_estimators()


def test_a_renamed_key_appended_with_plus_is_moved_and_reported(installed: dict[str, object]) -> None:
    """rllm's launch appends +trainer.val_generations_to_log_to_wandb=30 (0.2's key, which its vendored verl
    lacked); 0.4 renamed it trainer.log_val_generations, which verl 0.9.1 has: a plain override, in a line."""
    upgrade = _plan(["+trainer.val_generations_to_log_to_wandb=30"], installed, source="0.2")
    assert _texts(upgrade) == ["trainer.log_val_generations=30"]
    moved = [c for c in upgrade.changes if c.kind == "moved"]
    assert [(c.key, c.new_key) for c in moved] == [
        ("trainer.val_generations_to_log_to_wandb", "trainer.log_val_generations")
    ]


@pytest.mark.slow  # upgrade judges its advice with verl's validate_config
def test_advice_is_behaviour_verl_and_its_engine_accept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From 0.2: no line for a value verl 0.9.1 reads alike (min_lr_ratio null, resume_from_path false, the
    dummy_dtensor load format vLLM lacks and 0.2 handed it as 'dummy') or a key it does not read
    (data.return_raw_chat, data.val_batch_size); a real change (max_num_seqs 1024 -> 256) is one."""
    source = tmp_path / "run.yaml"
    source.write_text(
        "algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  model:\n    path: Qwen/Qwen2.5-0.5B-Instruct\n"
        "  actor:\n    ppo_micro_batch_size_per_gpu: 2\n  rollout:\n    n: 4\n"
        "    log_prob_micro_batch_size_per_gpu: 2\n  ref:\n    log_prob_micro_batch_size_per_gpu: 2\n"
    )
    code, out, _ = _upgrade(tmp_path, str(source), "--from", "0.2", "--format", "json", capsys=capsys)
    assert code == 0
    changes = json.loads(out)["changes"]
    keys = {c["new_key"] or c["key"] for c in changes if c["kind"] == "default"}
    unread = {
        f"{ARR}.rollout.load_format",
        "trainer.resume_from_path",
        "data.return_raw_chat",
        "data.val_batch_size",
    }
    assert not keys & {*unread, f"{ARR}.actor.optim.min_lr_ratio"}
    assert f"{ARR}.rollout.max_num_seqs=1024" in [c["fix"] for c in changes]


@pytest.mark.slow  # upgrade checks its advice with verl's validate_config
def test_a_projects_scripts_upgrade_in_one_run_as_each_alone(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """Several scripts in one run (verl imported once): each report and YAML is the one that script gets alone."""
    project = ROOT / "tests" / "data" / "upgrade_projects" / "Search-R1"
    scripts = [project / "train_grpo.sh", ROOT / "launch_examples" / "grpo_v05.sh"]
    together = cli("upgrade", *map(str, scripts), "-o", str(tmp_path / "all"), "--format", "json")
    assert together.code == 0, together.err
    documents = json.loads(together.out)["scripts"]
    assert [d["input"] for d in documents] == [str(s) for s in scripts]
    for script, document in zip(scripts, documents, strict=True):
        alone = cli("upgrade", str(script), "-o", str(tmp_path / script.stem), "--format", "json")
        single = json.loads(alone.out)
        assert {**document, "output": "", "command": ""} == {**single, "output": "", "command": ""}
        written = (tmp_path / "all" / f"{script.stem}.yaml").read_text()
        assert written == (tmp_path / script.stem / f"{script.stem}.yaml").read_text().replace(
            str(tmp_path / script.stem), str(tmp_path / "all")
        )


def test_one_bad_script_among_several_writes_nothing(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    good = ROOT / "launch_examples" / "grpo_v05.sh"
    missing = cli("upgrade", str(good), str(tmp_path / "gone.sh"), "-o", str(tmp_path / "out"))
    assert missing.code == 2 and "script not found" in missing.err and "Traceback" not in missing.err
    assert not (tmp_path / "out").exists()
    twin = tmp_path / "other" / "grpo_v05.sh"
    twin.parent.mkdir()
    twin.write_text(good.read_text())
    clash = cli("upgrade", str(good), str(twin), "-o", str(tmp_path / "out"))
    assert clash.code == 2 and "would both be written to" in clash.err
    picked = cli("upgrade", str(good), str(twin), "--launch", "1", "-o", str(tmp_path / "out"))
    assert picked.code == 2 and "--launch N picks a launch of one script" in picked.err
    assert not (tmp_path / "out").exists()

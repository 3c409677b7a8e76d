"""The ``check``, ``audit`` and ``migrate`` verbs: exit codes, JSON schema, script lines, the migrate round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import DATA, EXAMPLES, CliResult

from verl_safe_launch.compose import compose
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.render import render_findings_table
from verl_safe_launch.shell import ScriptLaunch, read_script

Cli = Callable[..., CliResult]
SCRIPTS = DATA / "scripts"
ARR = "actor_rollout_ref"
FLIP = SCRIPTS / "grpo_kl_flip.sh"


@pytest.fixture(autouse=True)
def no_hardware_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's GPUs (nvidia-smi, Slurm) must not change what these verbs report."""
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(name, raising=False)


# --- check ------------------------------------------------------------------------------------------------


def test_check_bundled_example_is_go(cli: Cli) -> None:
    result = cli("check", "-c", str(EXAMPLES / "grpo_6gpu.yaml"))
    assert result.code == 0, result.out
    assert result.out.rstrip().splitlines()[-1].startswith("GO: 0 errors")


def test_check_errors_exit_1_and_name_the_argument(cli: Cli) -> None:
    result = cli("check", "data.train_bach_size=3", f"{ARR}.rollout.name=vllm")
    assert result.code == 1
    assert (
        "error [unknown-key] unknown key data.train_bach_size: verl 0.9.1's config has no such key, so Hydra "
        "refuses 'data.train_bach_size=3'\n"
        "  data.train_bach_size = 3      from command line, argument 2 (data.train_bach_size=3)\n"
        "  fix: did you mean data.train_batch_size? data.train_batch_size=3\n"
    ) in result.out


def test_check_json_schema(cli: Cli) -> None:
    result = cli("check", "--format", "json", "trainer.nnodes=1", "trainer.nnodes=2")
    data = json.loads(result.out)
    assert result.code == 1
    assert list(data)[:5] == ["schema", "verdict", "summary", "verl", "findings"]
    assert data["verl"]["version"] == "0.9.1" and data["verl"]["tested"] is True
    assert (data["schema"], data["verdict"]) == (1, "no-go")
    assert set(data["summary"]) == {"errors", "warnings", "info"}
    duplicate = next(f for f in data["findings"] if f["rule_id"] == "duplicate-key")
    assert set(duplicate) == {"rule_id", "severity", "keys", "message", "fix", "sources"}
    assert [s["source"]["arg_index"] for s in duplicate["sources"]] == [4, 5]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("check", "-c", "/nonexistent/run.yaml"), "error: file not found: /nonexistent/run.yaml"),
        (("check", "data.train_batch_size=[1"), "error: invalid override 'data.train_batch_size=[1'"),
        (("check", "model_engine=nope"), "error: cannot compose verl's config"),
    ],
)
def test_check_bad_input_exits_2(cli: Cli, argv: tuple[str, ...], message: str) -> None:
    result = cli(*argv)
    assert result.code == 2
    assert result.err.startswith(message)


# --- audit ------------------------------------------------------------------------------------------------


def test_audit_false_then_true_warns_names_both_lines_and_strict_refuses(cli: Cli) -> None:
    """verl runs the script with the last value Hydra keeps: a warning (exit 0), which --strict turns into exit 1."""
    result = cli("audit", str(FLIP))
    assert result.code == 0
    assert cli("audit", str(FLIP), "--strict").code == 1
    assert (
        f"warning [duplicate-key] {ARR}.actor.use_kl_loss is set 2 times in script {FLIP}: false (line 14), "
        f"then true (line 24); Hydra silently keeps the last, true\n"
        f"  {ARR}.actor.use_kl_loss = false  from script, {FLIP}:14 ({ARR}.actor.use_kl_loss=False)\n"
        f"  {ARR}.actor.use_kl_loss = true   from script, {FLIP}:24 ({ARR}.actor.use_kl_loss=True)\n"
    ) in result.out
    verbose = cli("audit", str(FLIP), "--verbose")
    assert (
        f"info [duplicate-key] trainer.n_gpus_per_node is set 2 times in script {FLIP}, each time"
        in verbose.out
    )


def test_audit_passthrough_is_no_false_error(cli: Cli) -> None:
    script = SCRIPTS / "grpo_gsm8k.sh"
    result = cli("audit", str(script), "--verbose", "--", "trainer.nnodes=2", f"{ARR}.rollout.n=8")
    assert result.code == 0, result.out
    assert "error [" not in result.out
    assert (
        f"info [script-passthrough] trainer.nnodes=2 passed to the script (argument 5) replaces the script's 1 "
        f'({script}:45), as "$@" intends'
    ) in result.out


def test_audit_several_scripts_and_launches_json(cli: Cli) -> None:
    result = cli(
        "audit", "--format", "json", str(SCRIPTS / "two_launches.sh"), str(SCRIPTS / "megatron_strategy.sh")
    )
    data = json.loads(result.out)
    assert result.code == 1
    assert (data["schema"], data["verdict"]) == (1, "no-go")
    two, strategy = data["scripts"]
    assert [launch["line"] for launch in two["launches"]] == [7, 15]
    assert [launch["verdict"] for launch in two["launches"]] == ["go", "go"]
    assert two["launches"][1]["overrides"][3] == {"text": "data.train_batch_size=256", "line": 16}
    rules = [f["rule_id"] for f in strategy["launches"][0]["findings"] if f["severity"] == "error"]
    assert "engine-mismatch" in rules


def test_audit_unreadable_script_exits_2_and_audits_the_rest(cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("python3 -m verl.trainer.main_ppo a='x\n")
    result = cli("audit", str(bad), str(SCRIPTS / "megatron_config_name.sh"))
    assert result.code == 2
    assert f"== {bad}\nerror: cannot read {bad}: unterminated single quote\n  where: {bad}:1" in result.out
    assert "selects verl's deprecated ppo_megatron_trainer config" in result.out


def test_audit_without_scripts_is_usage_error(cli: Cli) -> None:
    result = cli("audit")
    assert result.code == 2
    assert result.err.startswith("error: the following arguments are required: PATH")


# --- migrate ----------------------------------------------------------------------------------------------

LAUNCHES = [launch for path in sorted(SCRIPTS.glob("*.sh")) for launch in read_script(path)]


@pytest.mark.parametrize("launch", LAUNCHES, ids=[f"{Path(x.path).name}:{x.line}" for x in LAUNCHES])
def test_migrate_round_trip(cli: Cli, tmp_path: Path, launch: ScriptLaunch) -> None:
    out = tmp_path / "run.yaml"
    result = cli("migrate", launch.path, "--launch", str(launch.index), "-o", str(out))
    assert result.code == 0, result.err
    command = result.out.strip().split()
    assert command[:1] == ["verl-safe-launch"]
    files = [Path(command[i + 1]) for i, word in enumerate(command) if word == "-c"]
    rest = [w.strip("'") for i, w in enumerate(command[1:], 1) if w != "-c" and command[i - 1] != "-c"]
    migrated = compose(ComposeRequest(overrides=cli_tokens(rest), config_files=tuple(files)))
    machine = {(n.line, n.raw) for n in launch.notes if n.kind == "machine"}
    kept = tuple(t for t in launch.tokens if (t.source.line, t.text) not in machine)
    original = compose(replace(launch, tokens=kept).request())
    env = "ray_kwargs.ray_init.runtime_env.env_vars."
    exported = {k: v for k, v in migrated.view.values.items() if k.startswith(env)}
    assert exported == {env + e.name: e.value for e in launch.exports}  # the script's exports, into Ray's env
    assert {k: v for k, v in migrated.view.values.items() if k not in exported} == dict(original.view.values)
    text = out.read_text()
    assert text.startswith(f"# verl config migrated from {launch.path} (the launch on line {launch.line}).")


def test_migrate_comments_cite_lines_and_replaced_values(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "run.yaml"
    assert cli("migrate", str(FLIP), "-o", str(out)).code == 0
    text = out.read_text()
    assert "    use_kl_loss: true  # grpo_kl_flip.sh:24 (replaces line 14: false)\n" in text
    assert '    path: "Qwen/Qwen2.5-0.5B-Instruct"  # grpo_kl_flip.sh:13\n' in text


def test_migrate_keeps_groups_on_the_command_line_and_lists_what_it_left_out(
    cli: Cli, tmp_path: Path
) -> None:
    out = tmp_path / "m.yaml"
    result = cli("migrate", str(SCRIPTS / "multiturn.sh"), "-o", str(out))
    assert result.code == 0
    assert result.out == f"verl-safe-launch -c {out}\n"
    assert (
        f"note: left out {ARR}.rollout.multi_turn.max_assistent_turns=5 (line 34): Could not override "
        f"'{ARR}.rollout.multi_turn.max_assistent_turns'. Run: verl-safe-launch audit {SCRIPTS / 'multiturn.sh'}"
    ) in result.err
    assert "note: not migrated: data.train_files=$HOME/data/gsm8k/train.parquet (line 39)" in result.err
    megatron = cli("migrate", str(SCRIPTS / "megatron_arrays.sh"), "-o", str(tmp_path / "meg.yaml"))
    assert megatron.out == f"verl-safe-launch -c {tmp_path / 'meg.yaml'} model_engine=megatron\n"


def test_migrate_refuses_to_overwrite_without_force(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "run.yaml"
    out.write_text("mine: 1\n")
    result = cli("migrate", str(FLIP), "-o", str(out))
    assert (result.code, result.err) == (
        2,
        f"error: {out} already exists\n  where: -o/--output\n  fix: pass --force to overwrite it, or choose another path\n",
    )
    assert out.read_text() == "mine: 1\n"
    assert cli("migrate", str(FLIP), "-o", str(out), "--force").code == 0
    assert out.read_text().startswith("# verl config migrated")
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]


def test_migrate_needs_a_launch_number_for_several_launches(cli: Cli, tmp_path: Path) -> None:
    result = cli("migrate", str(SCRIPTS / "two_launches.sh"), "-o", str(tmp_path / "x.yaml"))
    assert result.code == 2
    assert result.err == (
        f"error: {SCRIPTS / 'two_launches.sh'} has 2 launches: 1 (line 7), 2 (line 15)\n"
        "  fix: choose one with --launch N\n"
    )
    assert not (tmp_path / "x.yaml").exists()


# --- rendering and the installed console script -----------------------------------------------------------


def test_rich_table_groups_by_severity() -> None:
    findings = [
        Finding("rule-b", Severity.INFO, ("b",), "an observation", "nothing to do"),
        Finding("rule-a", Severity.ERROR, ("a",), "a problem", "a=1"),
    ]
    text = render_findings_table(findings, width=60)
    assert text.index("errors (1)") < text.index("rule-a") < text.index("info (1)") < text.index("rule-b")
    assert "\x1b[" not in text
    assert text.rstrip().endswith("NO-GO: 1 error, 0 warnings, 1 info")


def test_console_script_end_to_end() -> None:
    exe = Path(sys.executable).parent / "verl-safe-launch"
    done = subprocess.run(
        [str(exe), "audit", str(FLIP), "--strict"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert "line 14" in done.stdout and "line 24" in done.stdout


def test_migrate_preflights_what_it_wrote(cli: Cli, tmp_path: Path) -> None:
    clean, broken = DATA / "scripts" / "corpus" / "plain_0.sh", DATA / "scripts" / "corpus" / "plain_2.sh"
    result = cli("migrate", str(clean), "-o", str(tmp_path / "a.yaml"))
    assert "note: pre-flight of the migrated config: GO: 0 errors" in result.err
    result = cli("migrate", str(broken), "-o", str(tmp_path / "b.yaml"))
    assert result.code == 0
    assert "note: pre-flight of the migrated config: NO-GO: 3 errors" in result.err
    assert f"see them with: verl-safe-launch check -c {tmp_path / 'b.yaml'}" in result.err


def test_migrate_fix_writes_deprecated_keys_the_new_way_and_keeps_exports(cli: Cli, tmp_path: Path) -> None:
    script = tmp_path / "old.sh"
    script.write_text(
        "export VLLM_ATTENTION_BACKEND=XFORMERS\n"
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.ppo_micro_batch_size=16 \\\n"
        "  actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 trainer.n_gpus_per_node=8\n"
    )
    out = tmp_path / "new.yaml"
    result = cli("migrate", str(script), "-o", str(out), "--fix")
    assert result.code == 0, result.err
    assert (
        "fixed: actor_rollout_ref.actor.ppo_micro_batch_size -> actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (line 2): global micro batch 16 / 4 data-parallel ranks = 4 per GPU (4 ranks = 8 GPUs / Ulysses SP 2"
        in result.err
    )
    view = compose(ComposeRequest(config_files=(out,))).view
    assert view.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") == 4  # 16 / (8 GPUs / SP 2)
    assert view.get("actor_rollout_ref.actor.ppo_micro_batch_size") is None
    assert view.get("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size") == 2
    assert (
        view.get("actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size") == 2
    )  # it followed the actor
    assert view.get("ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ATTENTION_BACKEND") == "XFORMERS"
    check = cli("check", "-c", str(out))
    assert "deprecated-alias" not in check.out and "runtime_env" not in check.out


def test_info_notes_are_one_line_unless_verbose(cli: Cli) -> None:
    script = str(SCRIPTS / "grpo_gsm8k.sh")
    short, full = cli("audit", script), cli("audit", "--verbose", script)
    assert "info [" not in short.out and "--verbose lists them" in short.out
    assert full.out.count("info [") >= 2 and "--verbose lists them" not in full.out
    assert short.out.splitlines()[-1] == full.out.splitlines()[-1]  # the same verdict and counts


def test_fixes_pasted_after_a_config_file_stack_without_a_warning(cli: Cli) -> None:
    """The tool's own fix, pasted on the command line after ``-c FILE``, replaces the file's value: an intended
    override (info), so ``check`` goes from NO-GO to no warning about it, and ``--strict``-style gates pass on it."""
    base = ["-c", str(EXAMPLES / "grpo_6gpu.yaml"), "hardware.nodes=1", "hardware.gpus_per_node=6"]
    first = json.loads(cli("check", *base, "--format", "json").out)
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    broken = json.loads(cli("check", *base, f"{micro}=16", "--format", "json").out)
    (error,) = [f for f in broken["findings"] if f["rule_id"] == "batch-micro-divides-mini"]
    pasted = error["fix"].split(" ")[0]
    assert pasted.startswith(f"{micro}=")
    fixed = json.loads(cli("check", *base, pasted, "--format", "json").out)
    assert fixed["verdict"] == "go"
    shadowed = [f for f in fixed["findings"] if f["rule_id"] == "shadowed-value"]
    assert [f["severity"] for f in shadowed] == ["info"], "the file's 8 replaced on purpose"
    assert fixed["summary"]["warnings"] == first["summary"]["warnings"], "no warning beyond the file's own"

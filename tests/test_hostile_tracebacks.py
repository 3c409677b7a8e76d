"""Inputs that once ended in a traceback (exit 4) are compact errors (exit 2), and smaller gaps are closed."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DATA, EXAMPLES, CliResult

from verl_safe_launch.errors import InputError
from verl_safe_launch.launch import nodes_from_ray, nodes_from_state

Cli = Callable[..., CliResult]
GRPO = str(EXAMPLES / "grpo_6gpu.yaml")


@pytest.fixture(autouse=True)
def _no_host_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('!!float "abc"', "c.yaml:2: !!float 'abc' is not a valid float"),
        ('!!int "0xZZ"', "c.yaml:2: !!int '0xZZ' is not a valid int"),
        ('!!timestamp "x"', "c.yaml:2: !!timestamp 'x' is not a valid timestamp"),
        ('!!int "12"', None),  # a tag its value fits is read as YAML reads it
    ],
)
def test_a_yaml_tag_its_value_does_not_fit_is_exit_2(
    tmp_path: Path, cli: Cli, value: str, message: str | None
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  train_batch_size: {value}\n")
    result = cli("show", "-c", str(config), "--key", "data.train_batch_size")
    if message is None:
        assert (result.code, result.out.splitlines()[0]) == (0, "data.train_batch_size = 12")
        return
    assert result.code == 2
    assert result.err.splitlines()[0] == f"error: {tmp_path}/{message} ({_detail(value)})"
    assert "fix: remove the '!!" in result.err and "Traceback" not in result.err


def _detail(value: str) -> str:
    return {
        '!!float "abc"': "could not convert string to float: 'abc'",
        '!!int "0xZZ"': "invalid literal for int() with base 16: 'ZZ'",
        '!!timestamp "x"': "'NoneType' object has no attribute 'groupdict'",
    }[value]


LONG = "x" * 300


@pytest.mark.parametrize(
    "argv",
    [
        ["slurm", "--gpus-per-node", "2", "-o", "{d}/" + LONG + "/job.sbatch"],
        ["slurm", "--gpus-per-node", "2", "-o", "{d}/" + LONG],
        ["migrate", "{script}", "-o", "{d}/" + LONG + "/"],
        ["migrate", "{script}", "-o", "{d}/" + LONG],
        ["upgrade", "{script}", "-o", "{d}/" + LONG],
        ["kuberay", "--nodes", "1", "--gpus-per-node", "1", "--image", "x", "-o", "{d}/" + LONG],
        ["run", "--dry-run", "--force", "--run-dir", "{d}/" + LONG],
        ["submit", "--address", "http://127.0.0.1:9", "--run-dir", "{d}/" + LONG],
        ["run", "--dry-run", "--force", "--run-dir", "{d}/" + "y/" * 2100],
    ],
    ids=[
        "slurm-file",
        "slurm-name",
        "migrate-dir",
        "migrate-file",
        "upgrade",
        "kuberay",
        "run",
        "submit",
        "4k",
    ],
)
def test_a_path_the_kernel_refuses_for_its_length_is_exit_2(
    tmp_path: Path, cli: Cli, argv: list[str]
) -> None:
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.train_batch_size=8\n")
    result = cli(*(a.format(d=tmp_path, script=script) for a in argv))
    assert result.code == 2, result.err
    assert re.search(r"over the (255-byte limit of one file name|4,095-byte limit of a path)", result.err)
    assert "Traceback" not in result.err and "internal error" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.sh"]  # nothing was created


def test_a_long_override_is_not_a_path(tmp_path: Path, cli: Cli) -> None:
    """Only paths are held to the file name limit: an override of 300 characters is a value."""
    name = "n" * 300
    result = cli(
        "run", "--dry-run", "-c", GRPO, f"trainer.experiment_name={name}", "--run-dir", str(tmp_path / "r")
    )
    assert "limit of one file name" not in result.err


def _nested(depth: int, opening: str, closing: str) -> str:
    text = "x"
    for _ in range(depth):
        text = f"{opening}{text}{closing}"
    return text


@pytest.mark.parametrize(
    ("opening", "closing"), [("$(", ")"), ("$(echo ", ")"), ("${A:-", "}"), ("$((", "))"), ('"$(', ')"')]
)
def test_expansions_nested_past_the_limit_are_exit_2(
    tmp_path: Path, cli: Cli, opening: str, closing: str
) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"A={_nested(200, opening, closing)}\npython3 -m verl.trainer.main_ppo a=$A\n")
    result = cli("audit", str(script))
    assert result.code == 2
    shown = " ".join((result.out + result.err).split())  # the audit's report wraps long lines
    assert "expansions nested over 32 deep (the limit)" in shown
    assert "Traceback" not in result.err


def test_the_reproducer_of_664_bytes(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "run.sh"
    text = f"A={_nested(200, '$(', ')')}\npython3 -m verl.trainer.main_ppo data.train_batch_size=$A\n"
    script.write_text(text)
    assert len(text) < 700
    for verb in ("audit", "migrate"):
        result = cli(verb, str(script), *(["-o", str(tmp_path / "out.yaml")] if verb == "migrate" else []))
        assert result.code == 2 and "nested over 32 deep" in " ".join((result.out + result.err).split())


def test_expansions_nested_within_the_limit_are_read(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "run.sh"
    script.write_text(f"A={_nested(30, '$(echo ', ')')}\npython3 -m verl.trainer.main_ppo trainer.x=$A\n")
    result = cli("audit", str(script))
    assert result.code in (0, 1), result.err
    assert "nested over" not in result.err


@pytest.mark.parametrize("value", ["abc", "nan", "-8", "inf", None, [8], True])
def test_a_cluster_reporting_a_count_that_is_not_one_is_a_malformed_answer(value: object) -> None:
    entry = {"node_id": "abcdef0123", "node_ip": "10.0.0.2", "state": "ALIVE"}
    resources = {"CPU": 32.0, "GPU": value, "memory": 2**36}
    if value is None:
        resources.pop("GPU")  # no GPU key: a CPU node, not an error
        assert nodes_from_state([{**entry, "resources_total": resources}])[0].gpus == 0
        return
    with pytest.raises(
        InputError, match=r'the Ray cluster reported "GPU": .* for node 10.0.0.2 \(abcdef01\)'
    ):
        nodes_from_state([{**entry, "resources_total": resources}])
    with pytest.raises(InputError, match="not a count of resources"):
        nodes_from_ray([{"NodeID": "abcdef0123", "NodeManagerAddress": "10.0.0.2", "Resources": resources}])


def test_resources_that_are_not_a_mapping_are_a_malformed_answer() -> None:
    with pytest.raises(InputError, match="reported resources"):
        nodes_from_state([{"node_id": "n", "node_ip": "h", "state": "ALIVE", "resources_total": "lots"}])


def test_a_preset_file_of_ones_own_is_read_and_shown_by_its_path(tmp_path: Path, cli: Cli) -> None:
    preset = tmp_path / "team.yaml"
    preset.write_text("data:\n  train_batch_size: 32\n")
    for spelling in (str(preset), str(tmp_path / "team")):
        result = cli("show", f"preset={spelling}", "--key", "data.train_batch_size", "--origin")
        assert result.code == 0, result.err
        assert result.out.splitlines()[:2] == [
            "data.train_batch_size = 32",
            f"    from preset {spelling}, {preset}:2",
        ]


@pytest.mark.parametrize("key", ["defaults", "hydra"])
def test_a_defaults_or_hydra_key_in_a_preset_file_is_refused(tmp_path: Path, cli: Cli, key: str) -> None:
    preset = tmp_path / "team.yaml"
    preset.write_text(f"{key}:\n  - x\ndata:\n  train_batch_size: 32\n")
    result = cli("show", f"preset={preset}")
    assert result.code == 2
    assert result.err.splitlines()[:2] == [
        f"error: {preset}: the top-level '{key}:' is not applied from a preset (it is Hydra's, not verl's)",
        f"  where: {preset}:1",
    ]


def test_a_missing_preset_file_names_the_path(tmp_path: Path, cli: Cli) -> None:
    result = cli("show", f"preset={tmp_path}/nope")
    assert result.code == 2
    assert result.err.startswith(f"error: preset file not found: {tmp_path}/nope\n")


def test_migrate_of_a_job_reports_what_its_slurm_command_reaches(tmp_path: Path, cli: Cli) -> None:
    migrated = cli("migrate", str(DATA / "sbatch" / "mistakes.sbatch"), "-o", f"{tmp_path}/")
    assert migrated.code == 0, migrated.err
    command = migrated.out.strip().split()
    assert command[:2] == ["verl-safe-launch", "slurm"]
    note = migrated.err.splitlines()[-1]
    summary = re.search(r"(NO-GO|GO): \d+ errors?, \d+ warnings?, \d+ info", note)
    assert summary is not None and "see them with: verl-safe-launch slurm " in note
    slurm = cli(*command[1:])
    assert slurm.code == 1
    assert summary.group(0) in slurm.out + slurm.err

"""Hostile and malformed input: bounded time and memory, never a destructive write, never a traceback."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.errors import InputError, UsageError
from verl_safe_launch.files import check_target, make_directory, read_input, write_atomic
from verl_safe_launch.inputs import parse_yaml
from verl_safe_launch.shell import parse_script

Cli = Callable[..., CliResult]
ROOT = Path(__file__).resolve().parent.parent
SMALL = str(ROOT / "tests" / "data" / "slurm" / "grpo_small.yaml")
FLIP = str(ROOT / "tests" / "data" / "scripts" / "grpo_kl_flip.sh")
LAUNCH = "python3 -m verl.trainer.main_ppo"
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True)
)


# --- reading: only regular files, within limits -------------------------------------------------------------


@pytest.mark.parametrize("verb", ["check", "show"])
def test_a_fifo_or_a_device_is_refused_at_once(tmp_path: Path, cli: Cli, verb: str) -> None:
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    result = cli(verb, "-c", str(fifo))  # would block forever if opened for a blocking read
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        f"error: {fifo} is a named pipe (FIFO), not a regular file",
    )
    result = cli(verb, "-c", "/dev/zero")
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        "error: /dev/zero is a character device, not a regular file",
    )


def test_audit_refuses_a_named_fifo_and_walks_past_one(tmp_path: Path, cli: Cli) -> None:
    """A named FIFO is an unusable command line; a folder walk never opens one (it is not a regular file)."""
    fifo = tmp_path / "run.sh"
    os.mkfifo(fifo)
    result = cli("audit", str(fifo))
    assert result.code == 2
    assert f"error: {fifo} is a named pipe (FIFO), not a regular file" in result.out + result.err
    walked = cli("audit", str(tmp_path))
    assert walked.code == 0 and "0 scripts" in walked.out and "run.sh" not in walked.out


def test_size_limit_names_the_limit(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("x: 1\n" * 300_000)
    with pytest.raises(InputError, match=r"is larger than the 1024 KiB limit for a file$"):
        read_input(big)


def test_a_yaml_alias_bomb_fails_fast() -> None:
    assert len(ALIAS_BOMB) < 400
    with pytest.raises(InputError) as info:
        parse_yaml(ALIAS_BOMB, "bomb.yaml", expand_dots=True)
    assert "expands to more than 50,000 values (the limit; aliases count at every use)" in info.value.what


def test_a_self_referring_alias_is_an_input_error() -> None:
    with pytest.raises(InputError, match="refers to itself"):
        parse_yaml("a: &a [1, *a]\n", "loop.yaml", expand_dots=True)


def test_a_doubling_shell_variable_is_bounded() -> None:
    lines = ["V0=aaaaaaaaaaaaaaaa", *(f'V{i}="$V{i - 1}$V{i - 1}"' for i in range(1, 41))]
    text = "\n".join([*lines, f"{LAUNCH} data.train_files=$V40 data.train_batch_size=8"]) + "\n"
    launch = parse_script(text, "bomb.sh")[0]
    assert [t.text for t in launch.tokens] == ["data.train_batch_size=8"]
    [note] = [n for n in launch.notes if n.kind == "unresolved"]
    assert "a value longer than 65,536 characters (the limit; line" in note.detail


def test_a_crlf_script_is_an_error_with_a_pasteable_fix(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "run it.sh"
    script.write_bytes(f"{LAUNCH} \\\r\n  data.train_batch_size=8\r\n".encode())
    result = cli("audit", str(script))
    assert result.code == 1
    assert "error [script-crlf] the script has Windows (CRLF) line endings" in result.out
    assert f"fix: convert it to Unix line endings: sed -i 's/\\r$//' '{script}'" in result.out


@pytest.mark.parametrize("key", ["defaults", "hydra"])
def test_hydra_keys_in_a_user_yaml_are_reported(tmp_path: Path, cli: Cli, key: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  train_batch_size: 8\n{key}:\n  - x: y\n")
    result = cli("check", "-c", str(config))
    assert result.code == 2
    assert result.err.startswith(f"error: {config}: the top-level '{key}:' is not applied from a -c file")
    assert f"where: {config}:3" in result.err


# --- writing: never destructive --------------------------------------------------------------------------------


def test_write_keeps_the_mode_and_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "run.yaml"
    target.write_text("old\n")
    target.chmod(0o640)
    write_atomic(target, "new\n", force=True)
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_force_never_replaces_a_link_a_fifo_or_a_directory(tmp_path: Path, kind: str) -> None:
    target, victim = tmp_path / "out.yaml", tmp_path / "victim"
    victim.write_text("precious\n")
    if kind == "symlink":
        target.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    with pytest.raises(UsageError) as info:
        write_atomic(target, "x\n", force=True)
    assert info.value.what.startswith(f"{target} is a ")
    assert victim.read_text() == "precious\n"
    assert target.is_symlink() if kind == "symlink" else not target.is_file()


def test_an_input_is_never_a_write_target_even_with_force(tmp_path: Path) -> None:
    source = tmp_path / "x.sh"
    source.write_text("#!/bin/bash\n")
    with pytest.raises(
        UsageError, match="is an input of this command; it is never overwritten, even with --force"
    ):
        check_target(tmp_path / "." / "x.sh", force=True, inputs=[source])


def test_migrate_refuses_its_own_script_and_writes_into_a_directory(tmp_path: Path, cli: Cli) -> None:
    script = tmp_path / "flip.sh"
    script.write_text(Path(FLIP).read_text())
    result = cli("migrate", str(script), "-o", str(script), "--force")
    assert result.code == 2 and "is an input of this command" in result.err
    assert script.read_text() == Path(FLIP).read_text()
    result = cli("migrate", str(script), "-o", str(tmp_path), "--force")  # -o DIR: DIR/flip.yaml
    assert result.code == 0, result.err
    assert (tmp_path / "flip.yaml").is_file() and script.read_text() == Path(FLIP).read_text()
    (tmp_path / "flip.yaml").unlink()
    (tmp_path / "flip.yaml").mkdir()
    result = cli("migrate", str(script), "-o", str(tmp_path), "--force")
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        f"error: {tmp_path / 'flip.yaml'} is a directory; only a regular file is replaced",
    )


def test_slurm_never_replaces_its_own_config(tmp_path: Path, cli: Cli) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(Path(SMALL).read_text())
    result = cli(
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "-c",
        str(config),
        "-o",
        str(tmp_path / "job.sbatch"),
        "--force",
    )
    assert result.code == 2 and f"error: {config} is an input of this command" in result.err
    assert config.read_text() == Path(SMALL).read_text()


def test_slurm_temp_file_is_private_and_a_planted_link_is_harmless(tmp_path: Path, cli: Cli) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the old writer's predictable names
        (tmp_path / f".job.sbatch.tmp{pid}").symlink_to(victim)
    result = cli(
        "slurm", "--nodes", "1", "--gpus-per-node", "2", "-c", SMALL, "-o", str(tmp_path / "job.sbatch")
    )
    assert result.code == 0, result.err
    assert victim.read_text() == "precious\n"


def test_an_unwritable_directory_is_a_usage_error(cli: Cli) -> None:
    unwritable = Path("/proc")  # read-only even for root
    argv = ["slurm", "--nodes", "1", "--gpus-per-node", "2", "-c", SMALL]
    result = cli(*argv, "-o", str(unwritable / "j.sbatch"))
    assert result.code == 2 and result.err.startswith(f"error: cannot write {unwritable / 'j.'}")
    result = cli("run", "--dry-run", "-c", SMALL, "--run-dir", str(unwritable / "vsl-run"))
    assert result.code == 2 and result.err.startswith(f"error: cannot create {unwritable / 'vsl-run'}")


def test_run_directories_are_created_atomically(tmp_path: Path) -> None:
    base = tmp_path / "outputs" / "12-00-00"
    made = [make_directory(base) for _ in range(3)]
    assert made == [base, base.with_name("12-00-00_1"), base.with_name("12-00-00_2")]


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_run_dir_is_refused(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli("run", "--dry-run", "--run-dir", value, "-c", SMALL)
    assert result.code == 2
    assert result.err.startswith(f"error: --run-dir {value!r} is empty")
    assert list(tmp_path.iterdir()) == []


# --- check resolves the config the way verl does ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "problem", "fix"),
    [
        ("${oops.missing}", "Interpolation key 'oops.missing' not found", "set the key it refers to"),
        (
            "${oc.env:VSL_TEST_UNSET_VARIABLE}",
            "Environment variable 'VSL_TEST_UNSET_VARIABLE' not found",
            "export the variable",
        ),
        ("${nope:x}", "Unsupported interpolation type nope", "use one of OmegaConf's resolvers"),
        (
            "${data.train_batch_size}",
            "Recursive interpolation detected",
            "the interpolation refers to itself",
        ),
    ],
)
def test_check_reports_every_interpolation_that_does_not_resolve(
    cli: Cli, override: str, problem: str, fix: str
) -> None:
    result = cli("check", "-c", SMALL, f"data.train_batch_size={override}")
    assert result.code == 1
    head = f"error [config-unresolved] data.train_batch_size={override} does not resolve: "
    [line] = [ln for ln in result.out.splitlines() if ln.startswith(head)]
    assert problem in line
    assert f"from command line, argument 4 (data.train_batch_size={override})" in result.out
    assert f"  fix: data.train_batch_size: {fix}" in result.out
    shown = cli("show", "-c", SMALL, f"data.train_batch_size={override}")
    assert shown.code == 2 and shown.err.startswith(
        f"error: data.train_batch_size={override} does not resolve"
    )


@pytest.mark.parametrize("text", ["data: null\n", "data: hello\n"])
def test_a_section_replaced_by_a_value_is_an_error(tmp_path: Path, cli: Cli, text: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(text)
    result = cli("check", "-c", SMALL, "-c", str(config))
    assert result.code == 1
    assert "error [config-section] data is " in result.out
    assert f"from user file, {config}:1" in result.out


def test_deleting_a_section_is_an_error(cli: Cli) -> None:
    result = cli("check", "~data")
    assert result.code == 1
    assert "error [config-section] data was deleted: verl reads keys below data and stops" in result.out


@pytest.mark.parametrize("value", ["nan", ".inf", "1e41", "99999999999999999999999"])
def test_impossible_numbers_are_errors_not_hangs(cli: Cli, value: str) -> None:
    result = cli("check", "-c", SMALL, f"data.train_batch_size={value}")
    assert result.code == 1
    assert "error [type-mismatch] data.train_batch_size expects an integer" in result.out


def test_a_model_config_with_impossible_dimensions_is_an_input_error(tmp_path: Path, cli: Cli) -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    for key, value, shown in (("num_attention_heads", 0, "0"), ("vocab_size", '"100"', '"100"')):
        model = tmp_path / key
        model.mkdir()
        fields = {**base, key: value}
        (model / "config.json").write_text("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
        result = cli("check", "-c", SMALL, f"actor_rollout_ref.model.path={model}")
        assert result.code == 2
        assert result.err.startswith(f"error: {model}/config.json: {key} is {shown}, not a whole number")


# --- tool tokens and options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (["preset="], "error: 'preset=' names no preset"),
        (["preset=small", "preset=medium"], "error: two presets: preset=small"),
        (["+preset=small"], "error: '+preset=small': preset is a verl-safe-launch token, not a verl key"),
        (["hardware.gpu_memory_gb=1e300"], "error: hardware.gpu_memory_gb=1e300 is not a number of GB"),
        (["hardware.nodes=²"], "error: hardware.nodes=² is not a whole number"),
    ],
)
def test_tool_tokens_are_never_silently_ignored(cli: Cli, tokens: list[str], message: str) -> None:
    result = cli("check", "-c", SMALL, *tokens)
    assert result.code == 2
    assert result.err.startswith(message)


@pytest.mark.parametrize(
    ("preset", "nodes", "gpus"), [("medium", 256, 8), ("small", 31, 5), ("cluster", 127, 5)]
)
def test_preset_adaptation_on_odd_hardware_reports_instead_of_crashing(
    cli: Cli, preset: str, nodes: int, gpus: int
) -> None:
    result = cli("check", f"preset={preset}", f"hardware.nodes={nodes}", f"hardware.gpus_per_node={gpus}")
    assert result.code in (0, 1), result.err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--nodes", "1e20"], "argument --nodes: '1e20' is not a whole number from 1 to 100000"),
        (["--time", "abc"], "argument --time: 'abc' is not a Slurm time"),
        (["--mem", "10Q"], "argument --mem: '10Q' is not a Slurm memory size"),
        (
            ["--join-timeout", "0"],
            "argument --join-timeout: '0' is not a whole number of seconds, at least 1",
        ),
    ],
)
def test_slurm_options_follow_slurms_formats(
    tmp_path: Path, cli: Cli, option: list[str], message: str
) -> None:
    result = cli("slurm", "--gpus-per-node", "2", *option, "-c", SMALL, "-o", str(tmp_path / "j.sbatch"))
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        f"error: {message}" + result.err.splitlines()[0].split(message, 1)[1],
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["1-12", "90", "1:30", "24:00:00", "2-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(value: str) -> None:
    from verl_safe_launch.backends import time_arg

    assert time_arg(value) == value


def test_wait_ray_refuses_a_bad_address_and_timeout(cli: Cli) -> None:
    result = cli("slurm", "wait-ray", "--address=$(x)", "--timeout", "5", "n1")
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        "error: --address '$(x)' is not a Ray GCS address (HOST:PORT)",
    )
    result = cli("slurm", "wait-ray", "--address=10.0.0.1:6379", "--timeout", "-1", "n1")
    assert result.code == 2 and "argument --timeout: '-1'" in result.err


def test_estimate_refuses_a_nan_overhead(cli: Cli) -> None:
    result = cli("estimate", "-c", SMALL, "--overhead", "nan")
    assert (result.code, result.err.splitlines()[0]) == (2, "error: --overhead nan is outside [0, 1024] GiB")


def test_pasteable_hints_are_quoted(tmp_path: Path, cli: Cli) -> None:
    folder = tmp_path / "$(touch pwned)"
    folder.mkdir()
    result = cli(
        "slurm", "--nodes", "1", "--gpus-per-node", "2", "-c", SMALL, "-o", str(folder / "job.sbatch")
    )
    assert result.code == 0, result.err
    assert f"submit with: sbatch '{folder}/job.sbatch'" in result.out
    script = folder / "run.sh"
    script.write_text(f'{LAUNCH} data.train_files=$HOME/x "$@"\n')
    result = cli("audit", "--verbose", str(script))
    assert f"verl-safe-launch audit '{script}' -- KEY=VALUE" in result.out


def test_apptainer_binds_refuse_separators(tmp_path: Path, cli: Cli) -> None:
    folder = tmp_path / "a,b"
    folder.mkdir()
    argv = ["slurm", "--nodes", "1", "--gpus-per-node", "2", "--container", "img.sif", "-c", SMALL]
    result = cli(*argv, "-o", str(folder / "job.sbatch"))
    assert result.code == 2 and "which apptainer's --bind reads as separators" in result.err


# --- errors: exit codes, pipes, encodings ----------------------------------------------------------------------


def _run(
    argv: list[str], env: dict[str, str] | None = None, **kw: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verl_safe_launch", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
        **kw,  # type: ignore[arg-type]
    )


def test_full_error_never_changes_the_exit_code() -> None:
    plain = _run(["show", "data.train_bach_size=1"])
    full = _run(["show", "data.train_bach_size=1"], {"VSL_FULL_ERROR": "1"})
    assert plain.returncode == full.returncode == 2
    assert "Traceback" not in plain.stderr and "Traceback" in full.stderr


def test_non_ascii_output_on_an_ascii_terminal() -> None:
    proc = _run(["explain", "-c", SMALL], {"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0, proc.stderr
    assert "\\xd7" in proc.stdout  # the multiplication sign, escaped instead of crashing


def test_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.run(
        f"{sys.executable} -m verl_safe_launch show | head -1",
        shell=True,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ},
    )
    assert proc.stdout.count("\n") == 1
    assert proc.stderr == ""


def test_an_unexpected_exception_is_one_line_with_its_own_exit_code(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    import verl_safe_launch.cli._presets as presets_verb

    def broken(args: object, offset: int) -> int:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(presets_verb, "main", broken)
    result = cli("presets")
    assert (result.code, result.err) == (
        4,
        "internal error: RuntimeError: boom (a bug in verl-safe-launch; VSL_FULL_ERROR=1 for the traceback)\n",
    )
    monkeypatch.setenv("VSL_FULL_ERROR", "1")
    result = cli("presets")
    assert result.code == 4 and "Traceback" in result.err


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verl_safe_launch",
            "slurm",
            "wait-ray",
            "--address",
            "192.0.2.1:6379",
            "--timeout",
            "120",
            "n1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal, even where this test runs with SIGINT ignored (a background job of a
        # non-interactive shell): Python installs its handler only when SIGINT is not ignored at start.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Interrupt once it is connecting to an address nobody answers (TEST-NET-1): Ray's extension is loaded. A
    # fixed sleep raced a slow start on a loaded machine.
    deadline = time.monotonic() + 120
    while "_raylet" not in Path(f"/proc/{proc.pid}/maps").read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    try:
        _out, err = proc.communicate(timeout=60)
    finally:  # never hang the suite on a process that did not stop
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert [line for line in err.splitlines() if "gcs_client" not in line] == ["interrupted (Ctrl-C)"]


@pytest.mark.slow
def test_wait_ray_gives_up_connecting_at_its_timeout() -> None:
    proc = _run(["slurm", "wait-ray", "--address", "192.0.2.1:6379", "--timeout", "3", "n1"], timeout=60)
    assert proc.returncode == 3
    assert "error: cannot reach the job's Ray head at 192.0.2.1:6379 within 3 s" in proc.stderr


def test_a_user_file_with_too_many_keys_names_the_limit(tmp_path: Path, cli: Cli) -> None:
    config = tmp_path / "huge.yaml"
    config.write_text("".join(f"data.k{i}: {i}\n" for i in range(2_001)))
    result = cli("check", "-c", str(config))
    assert (result.code, result.err.splitlines()[0]) == (
        2,
        f"error: {config} sets 2,001 keys, over the limit of 2,000 for one file",
    )


def test_a_null_config_group_on_the_command_line_is_a_usage_error(cli: Cli) -> None:
    result = cli("check", "data=null")
    assert result.code == 2
    assert result.err.startswith(
        "error: cannot compose verl's config: Config group override must be a string"
    )

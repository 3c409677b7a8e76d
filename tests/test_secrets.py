"""No secret's value is written or printed: a key a launch script hard-codes, a value read through
``${oc.env:NAME}``; run directories are their owner's alone; which variables a submitted job gets.

The composition is verl's real config through Hydra, the script is read by the real parser and the dry run goes
through verl's own validation; submit against a cluster is in test_submit_cluster_answers.py.
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult

from verl_safe_launch.backends import choose_forwarding, env_forward_arg
from verl_safe_launch.errors import UsageError
from verl_safe_launch.secret import is_secret_name, redact

WANDB = "0123456789abcdef0123456789abcdef"
HF = "hf_notarealtokenbutlongenough"
SCRIPT = f"""#!/bin/bash
export WANDB_API_KEY={WANDB}
export HF_TOKEN="{HF}"
python3 -m verl.trainer.main_ppo \\
  data.train_batch_size=256 \\
  trainer.project_name=p-$WANDB_API_KEY \\
  trainer.experiment_name="$HF_TOKEN" \\
  actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
"""


@pytest.fixture(autouse=True)
def _no_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def test_migrate_keeps_a_hard_coded_key_out_of_the_yaml_and_the_terminal(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT)
    out = tmp_path / "out.yaml"
    result = cli("migrate", str(script), "-o", str(out))
    assert result.code == 0, result.out + result.err
    text = out.read_text()
    for shown in (text, result.out, result.err):
        assert WANDB not in shown and HF not in shown
    assert 'project_name: "p-${oc.env:WANDB_API_KEY}"' in text
    assert 'WANDB_API_KEY: "${oc.env:WANDB_API_KEY}"' in text
    audit = cli("audit", str(script), "--format", "json")
    assert WANDB not in audit.out + audit.err and HF not in audit.out + audit.err


def test_an_env_interpolated_secret_stays_a_name_in_the_run_directory_and_the_output(
    cli: Callable[..., CliResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_SERVICE_SECRET", "s3cr3t-value-not-real")
    run_dir = tmp_path / "run"
    result = cli(
        "run",
        "--dry-run",
        "--force",
        "--run-dir",
        str(run_dir),
        "-c",
        str(EXAMPLES / "grpo_6gpu.yaml"),
        "hardware.gpu_memory_gb=80",
        "trainer.project_name=${oc.env:MY_SERVICE_SECRET}",
    )
    assert result.code == 0, result.out + result.err
    assert "s3cr3t-value-not-real" not in result.out + result.err
    files = list(run_dir.rglob("*"))
    assert files and all("s3cr3t-value-not-real" not in p.read_text() for p in files)
    assert "project_name: ${oc.env:MY_SERVICE_SECRET}" in (run_dir / "config.yaml").read_text()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("WANDB_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("DB_PASSWORD", True),
        ("hf_token", True),
        ("TOKENIZERS_PARALLELISM", False),
        ("HF_TOKEN_PATH", False),
        ("NCCL_DEBUG", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_redact_finds_a_secret_in_its_json_and_shell_spellings() -> None:
    env = {"API_TOKEN": "ab\"cd\\ef'gh"}
    text = "a \"ab\\\"cd\\\\ef'gh\" b 'ab\"cd\\ef'\"'\"'gh'"
    assert redact(text, env) == "a \"${oc.env:API_TOKEN}\" b '${oc.env:API_TOKEN}'"
    assert redact("12345678", {"PIN_KEY": "12345678"}) == "12345678"  # digits only: not looked for


@pytest.mark.parametrize(
    "placeholder", ["TO_BE_FILLED", "<your-wandb-key>", "YOUR_API_KEY", "xxxxxxxx", "changeme"]
)
def test_a_placeholder_in_place_of_a_key_is_not_hidden(
    cli: Callable[..., CliResult], tmp_path: Path, placeholder: str
) -> None:
    """A shipped script often uses one placeholder for the key and for values to fill in: those stay readable."""
    assert (
        redact(f"trainer.nnodes={placeholder}", {"WANDB_API_KEY": placeholder})
        == f"trainer.nnodes={placeholder}"
    )
    script = tmp_path / "run.sh"
    script.write_text(
        f"export WANDB_API_KEY={placeholder}\npython3 -m verl.trainer.main_ppo "
        f"trainer.experiment_name='{placeholder}'\n"
    )
    result = cli("audit", str(script), "--format", "json")
    assert placeholder in result.out and "oc.env:WANDB_API_KEY" not in result.out


def test_forwarding_by_glob_or_default_never_picks_a_secret() -> None:
    env = {"HF_TOKEN": "x" * 10, "HF_HOME": "/h", "NCCL_DEBUG": "INFO", "MY_KEY": "k" * 10, "OTHER": "o"}
    default = choose_forwarding(env, None)
    assert default.values == {"HF_HOME": "/h", "NCCL_DEBUG": "INFO"} and default.held == ("HF_TOKEN",)
    globbed = choose_forwarding(env, env_forward_arg("*"))
    assert "HF_TOKEN" not in globbed.values and "MY_KEY" not in globbed.values and "OTHER" in globbed.values
    named = choose_forwarding(env, env_forward_arg("NCCL_*,HF_TOKEN"))
    assert named.values == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "x" * 10} and named.secrets == ("HF_TOKEN",)
    assert "x" * 10 not in str(named.record())
    assert choose_forwarding(env, env_forward_arg("none")).values == {}


@pytest.mark.parametrize("spec", ["", ",", "none,HF_HOME", "A B", "$(id)"])
def test_a_malformed_env_forward_is_a_usage_error(spec: str) -> None:
    with pytest.raises(UsageError):
        env_forward_arg(spec)


def test_migrate_of_a_slurm_job_leaves_an_exported_secret_to_the_submitting_environment(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --gres=gpu:8\nmodule load cuda\n"
        f"export WANDB_API_KEY={WANDB}\nexport NCCL_DEBUG=INFO HF_TOKEN={HF}\n"
        "python3 -m verl.trainer.main_ppo data.train_batch_size=256 "
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct trainer.n_gpus_per_node=8\n"
    )
    result = cli("migrate", str(job), "-o", str(tmp_path / "out.yaml"))
    assert result.code == 0, result.out + result.err
    command = result.out.splitlines()[0]
    assert "--setup 'module load cuda' --setup 'export NCCL_DEBUG=INFO' -c" in command
    assert "WANDB_API_KEY" not in command and "HF_TOKEN" not in command and "oc.env" not in command
    assert "export WANDB_API_KEY (line 5) is not carried over: it sets a secret" in result.out + result.err
    assert "export HF_TOKEN (line 6) is not carried over" in result.out + result.err
    assert WANDB not in result.out + result.err and HF not in result.out + result.err

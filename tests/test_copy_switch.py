"""Several verl copies judged in one process (a folder of projects, each with the verl it vendors): what one copy's
composition taught must not answer for another's. verl's YAML files are named alike in every copy
(``verl/trainer/config/...``), so facts cached by file name alone leaked from one copy to the next."""

from __future__ import annotations

from pathlib import Path

from verl_safe_launch.backends import bringup_findings
from verl_safe_launch.inputs import choose_verl
from verl_safe_launch.preflight import Auditor

SNAPSHOT = Path(__file__).parent / "data" / "verl_copies" / "main-0.10.0.dev"
LAUNCH = (
    "python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer "
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.megatron.{key}=true\n"
)


def _errors_on(script: Path, key: str) -> list[str]:
    result = Auditor(job_findings=bringup_findings).script(script)
    return [
        f.rule_id
        for launch in result.launches
        for f in launch.findings
        if key in f.keys and f.severity.value == "error"
    ]


def test_a_keys_verdict_follows_the_copy_chosen_after_another(tmp_path: Path) -> None:
    """``grad_offload`` is in the snapshot's megatron engine config and nowhere in verl 0.9.1's (Hydra refuses it)."""
    script = tmp_path / "run.sh"
    script.write_text(LAUNCH.format(key="grad_offload"))
    key = "actor_rollout_ref.actor.megatron.grad_offload"
    try:
        for _ in range(2):  # each copy after the other, both ways
            choose_verl(None)
            assert _errors_on(script, key) == ["unknown-key"], "verl 0.9.1 has no such key"
            choose_verl(SNAPSHOT, "--verl")
            assert _errors_on(script, key) == [], "the snapshot has it"
    finally:
        choose_verl(None)

"""Every finding cites every key its arithmetic reads: changing a key it does not cite leaves it as it was.

For each error and warning on a few configs that break many rules at once, each key of ``PERTURB`` that the finding
does not cite (``depends_on``: its keys, its sources and what it read) is changed; the finding must stay, word for
word, unless the change moved the value of a cited key (verl's interpolations: the reference's parallel sizes
follow the actor's).
"""

from __future__ import annotations

import pytest
from test_audit import composed

from verl_safe_launch.audit import depends_on
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import HardwareProfile
from verl_safe_launch.preflight import run_preflight

ARR = "actor_rollout_ref"
COMMON = (f"{ARR}.rollout.name=vllm", f"{ARR}.actor.use_kl_loss=True", "trainer.nnodes=1")
BASES = {
    "megatron": (
        *COMMON,
        "model_engine=megatron",
        f"{ARR}.actor.megatron.tensor_model_parallel_size=2",
        f"{ARR}.actor.megatron.pipeline_model_parallel_size=2",
        "data.train_batch_size=24",
        f"{ARR}.actor.ppo_mini_batch_size=12",
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu=5",
        f"{ARR}.rollout.n=3",
        f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=7",
        f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=7",
        f"{ARR}.rollout.tensor_model_parallel_size=3",
        "trainer.n_gpus_per_node=8",
        "algorithm.adv_estimator=grpo",
    ),
    "fsdp-critic": (
        *COMMON,
        "data.train_batch_size=20",
        f"{ARR}.actor.ppo_mini_batch_size=30",
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu=7",
        f"{ARR}.rollout.n=5",
        f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=3",
        f"{ARR}.actor.ulysses_sequence_parallel_size=2",
        "trainer.n_gpus_per_node=6",
        "algorithm.adv_estimator=gae",
        "critic.ppo_micro_batch_size_per_gpu=3",
    ),
}
PERTURB = (
    f"{ARR}.actor.megatron.tensor_model_parallel_size=4",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size=1",
    f"{ARR}.actor.megatron.context_parallel_size=2",
    f"{ARR}.ref.megatron.tensor_model_parallel_size=4",
    "trainer.n_gpus_per_node=4",
    "trainer.nnodes=2",
    f"{ARR}.rollout.n=2",
    "data.train_batch_size=48",
    f"{ARR}.actor.ppo_mini_batch_size=6",
    f"{ARR}.rollout.tensor_model_parallel_size=2",
    f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size=1",
    f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=2",
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=2",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_mini_batch_size=4",
    "data.max_response_length=4096",
)
HARDWARE = HardwareProfile()


def _judged(overrides: tuple[str, ...]) -> tuple[list[Finding], object]:
    config = composed(*overrides)
    found = run_preflight(config, HARDWARE).findings
    return [f for f in found if f.severity is not Severity.INFO], config.view


def _cites(finding: Finding, key: str) -> bool:
    return any(key == d or key.startswith(d + ".") or d.startswith(key + ".") for d in depends_on(finding))


@pytest.mark.parametrize("base", sorted(BASES))
def test_changing_a_key_a_finding_does_not_cite_leaves_it_unchanged(base: str) -> None:
    overrides = BASES[base]
    findings, view = _judged(overrides)
    assert len({f.rule_id for f in findings}) >= 4, "the base config must break several rules"
    uncited: dict[str, set[str]] = {}
    for change in PERTURB:
        key = change.partition("=")[0]
        if change in overrides:
            continue
        after, changed_view = _judged((*overrides, change))
        kept = {(f.rule_id, f.message) for f in after}
        for finding in findings:
            cited = depends_on(finding)
            moved = any(view.get(k) != changed_view.get(k) for k in cited)  # type: ignore[attr-defined]
            if not _cites(finding, key) and not moved and (finding.rule_id, finding.message) not in kept:
                uncited.setdefault(finding.rule_id, set()).add(key)
    assert uncited == {}, uncited


def test_a_parallel_size_from_the_environment_is_not_taken_as_one(tmp_path: object) -> None:
    """TP from ``$TP``: the data-parallel size is unknown, so a micro batch that fails at TP 1 cannot be verified."""
    from pathlib import Path

    from verl_safe_launch.preflight import Auditor

    path = Path(str(tmp_path)) / "run.sh"
    path.write_text(
        f"python3 -m verl.trainer.main_ppo {' '.join(COMMON)} model_engine=megatron algorithm.adv_estimator=grpo "
        f"{ARR}.actor.megatron.tensor_model_parallel_size=$TP data.train_batch_size=64 {ARR}.rollout.n=4 "
        f"{ARR}.actor.ppo_mini_batch_size=16 {ARR}.actor.ppo_micro_batch_size_per_gpu=3 "
        f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4 {ARR}.ref.log_prob_micro_batch_size_per_gpu=4 "
        "trainer.n_gpus_per_node=8\n"
    )
    item = Auditor().script(path).launches[0]
    assert "batch-micro-divides-mini" not in {
        f.rule_id for f in item.findings if f.severity is Severity.ERROR
    }
    doubtful = [f.message for f in item.findings if f.rule_id == "cannot-verify"]
    assert any("[batch-micro-divides-mini]" in m and "$TP" in m for m in doubtful), doubtful

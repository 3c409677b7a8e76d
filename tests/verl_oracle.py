"""Differential oracle: generated batch configs judged by verl's own ``validate_config`` and by our rules.

Shared by tests/test_differential.py (a short run) and bench/differential.py (the full run).
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from recompose import recompose

from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import load_architecture
from verl_safe_launch.rules import run_rules

ARR = "actor_rollout_ref"
MICRO_FORMS = st.sampled_from(["per_gpu", "per_gpu", "per_gpu", "deprecated", "both", "neither"])
SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32])


def _micro(prefix: str, name: str, form: str, value: int) -> list[str]:
    per_gpu = f"{prefix}.{name}_per_gpu"
    deprecated = f"{prefix}.{name}"
    return {
        "per_gpu": [f"{per_gpu}={value}"],
        "deprecated": [f"{deprecated}={value * 8}", f"{per_gpu}=null"],
        "both": [f"{deprecated}={value * 8}", f"{per_gpu}={value}"],
        "neither": [f"{per_gpu}=null"],
    }[form]


@st.composite
def configs(draw: st.DrawFn) -> list[str]:
    """Overrides over the batch-relevant keys of verl's config (the model paths are added by the caller)."""
    engine = draw(st.sampled_from(["dp", "dp", "dp", "megatron"]))
    out = [f"model_engine={engine}", f"{ARR}.rollout.name=vllm"]
    out += [
        f"trainer.n_gpus_per_node={draw(st.sampled_from([1, 2, 4, 6, 8]))}",
        f"trainer.nnodes={draw(st.sampled_from([1, 1, 2]))}",
        f"data.train_batch_size={draw(st.integers(1, 128))}",
        f"{ARR}.rollout.n={draw(st.integers(1, 16))}",
        f"{ARR}.actor.ppo_mini_batch_size={draw(st.integers(1, 128))}",
        f"{ARR}.rollout.tensor_model_parallel_size={draw(st.sampled_from([1, 2, 3, 4, 8]))}",
        f"algorithm.adv_estimator={draw(st.sampled_from(['grpo', 'gae']))}",
        f"{ARR}.actor.use_kl_loss={draw(st.booleans())}",
        f"data.max_prompt_length={draw(st.sampled_from([256, 512, 1024]))}",
        f"data.max_response_length={draw(st.sampled_from([256, 512, 1024, 2048]))}",
    ]
    out += _micro(f"{ARR}.actor", "ppo_micro_batch_size", draw(MICRO_FORMS), draw(SIZES))
    out += _micro(f"{ARR}.rollout", "log_prob_micro_batch_size", draw(MICRO_FORMS), draw(SIZES))
    out += _micro(f"{ARR}.ref", "log_prob_micro_batch_size", draw(MICRO_FORMS), draw(SIZES))
    out += _micro("critic", "ppo_micro_batch_size", draw(MICRO_FORMS), draw(SIZES))
    out += draw(_dynamic()) + draw(_parallel(engine))
    return out


@st.composite
def _dynamic(draw: st.DrawFn) -> list[str]:
    if not draw(st.booleans()):
        return []
    budgets = st.sampled_from([256, 512, 1024, 2048, 4096, 16384])
    return [
        f"{ARR}.actor.use_dynamic_bsz=true",
        f"{ARR}.actor.ppo_max_token_len_per_gpu={draw(budgets)}",
        f"{ARR}.rollout.log_prob_max_token_len_per_gpu={draw(budgets)}",
        f"{ARR}.ref.log_prob_max_token_len_per_gpu={draw(budgets)}",
        f"+critic.ppo_infer_max_token_len_per_gpu={draw(budgets)}",
    ]


@st.composite
def _parallel(draw: st.DrawFn, engine: str) -> list[str]:
    if engine == "megatron":
        meg = f"{ARR}.actor.megatron"
        return [
            f"{meg}.tensor_model_parallel_size={draw(st.sampled_from([1, 2, 4]))}",
            f"{meg}.pipeline_model_parallel_size={draw(st.sampled_from([1, 1, 2]))}",
            f"{meg}.context_parallel_size={draw(st.sampled_from([1, 1, 2]))}",
        ]
    sp_key = draw(
        st.sampled_from(["fsdp_config.ulysses_sequence_parallel_size", "ulysses_sequence_parallel_size"])
    )
    return [
        f"{ARR}.actor.{sp_key}={draw(st.sampled_from([1, 1, 2, 4]))}",
        f"{ARR}.model.use_remove_padding={draw(st.sampled_from([True, True, False]))}",
    ]


def with_models(overrides: list[str], model: Path) -> list[str]:
    """The overrides plus the tiny local model as actor and critic (verl loads the critic's in validate_config)."""
    return [*overrides, f"{ARR}.model.path={model}", f"critic.model.path={model}"]


def verl_verdict(cfg: Any) -> str | None:
    """verl's own driver-side validation, exactly as ``main_ppo.main`` calls it; None when it accepts."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            auto_set_device(cfg)
            use_ref, use_critic = need_reference_policy(cfg), need_critic(cfg)
            validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)
        except Exception as exc:  # verl raises ValueError, AssertionError, TypeError, Hydra errors
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return None


def our_errors(composed: Any, hardware: HardwareFacts) -> list[Finding]:
    """The errors of our rules (and of the override audit, when it is installed)."""
    view = composed.view
    actor = load_architecture(view.get(f"{ARR}.model.path"))
    critic = load_architecture(view.get("critic.model.path"))
    findings = run_rules(RuleContext(view, actor, critic, hardware))
    with contextlib.suppress(ImportError):
        from verl_safe_launch.audit import audit

        findings += audit(composed)
    return [f for f in findings if f.severity is Severity.ERROR]


@dataclass
class Tally:
    """What the differential found: agreements, misses (verl rejects, we accept) and early catches by rule."""

    total: int = 0
    verl_rejects: int = 0
    both_reject: int = 0
    both_accept: int = 0
    misses: list[tuple[list[str], str]] = field(default_factory=list)
    early: Counter[str] = field(default_factory=Counter)
    early_configs: int = 0
    verl_reasons: Counter[str] = field(default_factory=Counter)

    def add(self, overrides: list[str], verl: str | None, ours: list[Finding]) -> None:
        """Record one config."""
        self.total += 1
        if verl is not None:
            self.verl_rejects += 1
            self.verl_reasons[_gist(verl)] += 1
            if ours:
                self.both_reject += 1
            else:
                self.misses.append((overrides, verl))
        elif ours:
            self.early_configs += 1
            self.early.update({f.rule_id for f in ours})
        else:
            self.both_accept += 1


def _gist(message: str) -> str:
    """The inner error of a Hydra instantiation error, digits folded, cut to one line."""
    inner = re.search(r"(\w+(?:Error|Exception))\((['\"])(.*?)\2", message)
    text = f"{inner.group(1)}: {inner.group(3)}" if inner else message.split(": ", 1)[-1]
    return re.sub(r"\d+", "N", text)[:90]


def judge(
    overrides: list[str], model: Path, hardware: HardwareFacts, tally: Tally
) -> tuple[str | None, list[Finding]]:
    """Compose once, ask verl and our rules, record the outcome."""
    full = with_models(overrides, model)
    composed = recompose(full)
    ours = our_errors(composed, hardware)
    verl = verl_verdict(composed.cfg)
    tally.add(full, verl, ours)
    return verl, ours

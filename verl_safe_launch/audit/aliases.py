"""verl 0.9.1's deprecated spellings and accepted-but-ignored keys, as tables (the audit's knowledge of verl)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import verl_cache, verl_files, verl_package_dir
from verl_safe_launch.provenance import Layer, Write

_LATE_FAIL = (
    "verl 0.9.1 accepts it in validate_config, then stops with a bare AssertionError when the workers start"
)
_CRITIC_TOKENS = "the critic worker balances micro batches by tokens and never reads micro batch sizes"


@dataclass(frozen=True)
class Alias:
    """A deprecated key and its replacement: what verl does with the old one alone, and with both set."""

    old: str
    new: str
    alone: Severity
    why: str
    both: str
    fix: str = "{new}={value}"
    gate: str = ""
    """A micro-batch pair verl checks only while this key is false; such a pair is a ``verl-*-micro-keys`` finding."""


_CRITIC_FIX = "delete {old}; size the critic with {budget}"
ALIASES: tuple[Alias, ...] = (
    Alias(
        f"{ARR}.actor.ppo_micro_batch_size",
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu",
        Severity.ERROR,
        _LATE_FAIL,
        "verl refuses the pair in validate_config",
        gate=f"{ARR}.actor.use_dynamic_bsz",
    ),
    Alias(
        f"{ARR}.rollout.log_prob_micro_batch_size",
        f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu",
        Severity.ERROR,
        _LATE_FAIL,
        "verl refuses the pair in validate_config",
        gate=f"{ARR}.actor.use_dynamic_bsz",
    ),
    Alias(
        f"{ARR}.ref.log_prob_micro_batch_size",
        f"{ARR}.ref.log_prob_micro_batch_size_per_gpu",
        Severity.ERROR,
        _LATE_FAIL,
        "verl refuses the pair in validate_config",
        gate=f"{ARR}.actor.use_dynamic_bsz",
    ),
    Alias(
        "critic.ppo_micro_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
        Severity.ERROR,
        "critic.ppo_micro_batch_size_per_gpu interpolates it (${oc.select:.ppo_micro_batch_size,null}), so verl "
        "0.9.1 always sees both set and raises 'You have set both' naming critic.micro_batch_size; "
        f"besides, {_CRITIC_TOKENS}",
        "verl refuses the pair",
        _CRITIC_FIX,
        gate="critic.use_dynamic_bsz",
    ),
    Alias(
        "critic.forward_micro_batch_size",
        "critic.forward_micro_batch_size_per_gpu",
        Severity.WARNING,
        _CRITIC_TOKENS,
        "neither has an effect",
        _CRITIC_FIX,
    ),
    Alias(
        f"{ARR}.actor.ulysses_sequence_parallel_size",
        f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size",
        Severity.WARNING,
        "verl 0.9.1 still copies it into fsdp_config when it is above 1",
        "the deprecated value overwrites the new one when it is above 1",
    ),
    Alias(
        "critic.ulysses_sequence_parallel_size",
        "critic.fsdp.ulysses_sequence_parallel_size",
        Severity.WARNING,
        "verl 0.9.1 does not copy it into critic.fsdp, so it has no effect on the critic",
        "only the critic.fsdp value takes effect",
    ),
    *(
        Alias(
            f"{role}.optim.grad_clip",
            f"{role}.optim.clip_grad",
            Severity.WARNING,
            "the optimizer config copies it into clip_grad",
            "the deprecated grad_clip silently wins",
        )
        for role in (f"{ARR}.actor", "critic")
    ),
    *(
        Alias(
            f"{role}.optim.warmup_style",
            f"{role}.optim.lr_scheduler_type",
            Severity.WARNING,
            "the FSDP optimizer config copies it into lr_scheduler_type",
            "the deprecated warmup_style silently wins",
        )
        for role in (f"{ARR}.actor", "critic")
    ),
    Alias(
        "trainer.remove_previous_ckpt_in_save",
        "trainer.max_actor_ckpt_to_keep",
        Severity.WARNING,
        "the trainer turns it into max_actor_ckpt_to_keep=1 and max_critic_ckpt_to_keep=1",
        "the deprecated key wins and keeps one checkpoint",
        "trainer.max_actor_ckpt_to_keep=1 trainer.max_critic_ckpt_to_keep=1",
    ),
)

Predicate = Callable[[object, ConfigView], bool]


def _set(value: object, view: ConfigView) -> bool:
    return value is not None


def _false(value: object, view: ConfigView) -> bool:
    return value is False


def _v1(value: object, view: ConfigView) -> bool:
    return view.get("trainer.use_v1") is True


def _sync(value: object, view: ConfigView) -> bool:
    return value == "sync"


@dataclass(frozen=True)
class Ignored:
    """A key verl 0.9.1 accepts but does not act on (when ``when`` holds), what it does instead, and a fix."""

    pattern: str
    why: str
    fix: str
    when: Predicate = _set
    severity: Severity = Severity.WARNING


_V1_BUDGET = "the V1 trainer trains and infers the critic with +critic.ppo_infer_max_token_len_per_gpu"
CRITIC_BUDGET = (
    "critic.ppo_max_token_len_per_gpu (legacy trainer) or +critic.ppo_infer_max_token_len_per_gpu (V1)"
)
IGNORED: tuple[Ignored, ...] = (
    *(
        Ignored(
            f"{legacy}.*",
            f"main_ppo ignores the legacy top-level {legacy}.* keys (only the fully async entry point migrates them)",
            "{new}={value}",
        )
        for legacy in ("reward_model", "custom_reward_function", "sandbox_fusion")
    ),
    Ignored(
        "critic.ppo_micro_batch_size_per_gpu", _CRITIC_TOKENS, "remove it; size the critic with {budget}"
    ),
    Ignored(
        "critic.forward_micro_batch_size_per_gpu", _CRITIC_TOKENS, "remove it; size the critic with {budget}"
    ),
    Ignored(
        "critic.use_dynamic_bsz",
        "the critic worker always balances by tokens (its engine's use_dynamic_bsz stays true)",
        "remove it; size the critic with {budget}",
        _false,
    ),
    Ignored(
        "critic.ppo_max_token_len_per_gpu", _V1_BUDGET, "+critic.ppo_infer_max_token_len_per_gpu={value}", _v1
    ),
    Ignored(
        "trainer.balance_batch",
        "the V1 trainer always balances batches",
        "remove it (the V1 trainer ignores it)",
        _v1,
    ),
    *(
        Ignored(
            f"{role}.grad_clip",
            "no engine reads it; gradients are clipped by optim.clip_grad",
            f"{role}.optim.clip_grad={{value}}",
        )
        for role in (f"{ARR}.actor", "critic")
    ),
    *(
        Ignored(
            f"{ARR}.actor.ppo_infer_{name}",
            "no verl 0.9.1 worker reads it; the actor's log-prob pass uses the rollout's log_prob_* keys",
            f"{ARR}.rollout.log_prob_{name}={{value}}",
        )
        for name in ("micro_batch_size_per_gpu", "max_token_len_per_gpu")
    ),
    Ignored("data.val_batch_size", "validation data goes to the inference engines as one batch", "remove it"),
    Ignored(
        f"{ARR}.rollout.mode",
        "rollout mode 'sync' was removed; the rollout workers raise ValueError when they start",
        f"{ARR}.rollout.mode=async",
        _sync,
        Severity.ERROR,
    ),
)

LEGACY_REWARD = {
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_loop_source": "reward.reward_manager.source",
    "reward_model.reward_loop_module_path": "reward.reward_manager.module.path",
    "reward_model.reward_loop_class_name": "reward.reward_manager.module.name",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.reward_kwargs": "reward.reward_kwargs",
}
_LEGACY_PREFIXES = {
    "reward_model.rollout.": "reward.reward_model.rollout.",
    "reward_model.": "reward.reward_model.",
    "custom_reward_function.": "reward.custom_reward_function.",
    "sandbox_fusion.": "reward.sandbox_fusion.",
}


def legacy_reward_key(key: str) -> str:
    """Where ``migrate_legacy_reward_impl`` would have moved a legacy top-level reward key."""
    if key in LEGACY_REWARD:
        return LEGACY_REWARD[key]
    for old, new in _LEGACY_PREFIXES.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def matches(pattern: str, key: str) -> bool:
    """``prefix.*`` matches every key below prefix; anything else matches itself."""
    if pattern.endswith(".*"):
        return key.startswith(pattern[:-1])
    return key == pattern


def covered(key: str) -> bool:
    """True when a table above already explains this key."""
    return any(a.old == key or a.new == key for a in ALIASES) or any(matches(i.pattern, key) for i in IGNORED)


_DEPRECATED = re.compile(r"\bdeprecated\b", re.IGNORECASE)


_MARKED: dict[tuple[str | None, ...], dict[str, str]] = {}


def yaml_deprecations(writes: Sequence[Write]) -> dict[str, str]:
    """Keys whose comment in verl's own YAML calls them deprecated, with that comment."""
    files = verl_files(writes)
    if files not in _MARKED:
        marked: dict[str, str] = {}
        for write in writes:
            src = write.source
            if src.layer is Layer.VERL and src.file and src.line:
                comment = _comment_above(src.file, src.line)
                if _DEPRECATED.search(comment):
                    marked[write.key] = comment
        _MARKED[files] = marked
    return _MARKED[files]


def _comment_above(file: str, line: int) -> str:
    lines = _lines(file)
    block: list[str] = []
    index = line - 2
    while 0 <= index < len(lines) and lines[index].lstrip().startswith("#"):
        block.insert(0, lines[index].strip().lstrip("#").strip())
        index -= 1
    return " ".join(b for b in block if b)


@verl_cache
def _lines(file: str) -> tuple[str, ...]:
    path = Path(file)
    if not path.is_absolute():
        path = verl_package_dir().parent / path
    try:
        return tuple(path.read_text(encoding="utf-8").splitlines())
    except OSError:
        return ()

"""Upgrade a launch written for an older verl release: moved keys mapped, semantic changes applied, the rest reported."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from verl_safe_launch.audit.aliases import ALIASES, legacy_reward_key
from verl_safe_launch.audit.history import (
    INSTALLED_SERIES,
    RELEASES,
    TAGS,
    Move,
    generated_moves,
    history,
    series_of,
    version,
)
from verl_safe_launch.audit.migrate import hydra_literal
from verl_safe_launch.audit.parallel import ACTOR_SP, REF_SP, Layout, plain_int, read_layout
from verl_safe_launch.audit.values import REQUIRED_HINTS, REQUIRED_WHEN
from verl_safe_launch.config_view import ARR, format_value
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import OverrideToken

_PROFILER = "profiling options were gathered in the global_profiler section"
_RAY = "Ray's init options moved under ray_kwargs"
_REWARD = "reward settings moved under reward.* in 0.7.1, and 0.9 no longer reads the top-level keys"
_CHECKPOINT = "checkpoint.contents was split into save_contents and load_contents (which follows save_contents by default)"
_LEGACY_READ = "verl 0.9.1's main_ppo reads reward settings only under reward.*; the top-level key is accepted and ignored"

# Moves the history cannot derive (the leaf changed, or the old key lingered as an ignored legacy key).
HAND_MOVES: tuple[Move, ...] = (
    Move("trainer.profile_steps", "global_profiler.steps", "0.6.0", _PROFILER),
    Move("ray_init.num_cpus", "ray_kwargs.ray_init.num_cpus", "0.6.0", _RAY),
    Move("ray_init.timeline_json_file", "ray_kwargs.timeline_json_file", "0.6.0", _RAY),
    Move(
        "trainer.val_generations_to_log_to_wandb",
        "trainer.log_val_generations",
        "0.4.0",
        "the number of validation generations to log was renamed when more loggers than wandb took them",
    ),
    Move("reward_model.enable", "reward.reward_model.enable", "0.9.0", _REWARD),
    Move("reward_model.model.path", "reward.reward_model.model_path", "0.9.0", _REWARD),
    Move("reward_model.reward_manager", "reward.reward_manager.name", "0.9.0", _REWARD),
    Move("custom_reward_function.path", "reward.custom_reward_function.path", "0.9.0", _REWARD),
    Move("custom_reward_function.name", "reward.custom_reward_function.name", "0.9.0", _REWARD),
    *(
        Move(f"{role}.checkpoint.contents", f"{role}.checkpoint.save_contents", "0.4.1", _CHECKPOINT)
        for role in (f"{ARR}.actor", "critic")
    ),
)


@dataclass(frozen=True)
class Removed:
    """A key (or one value of a key) a release dropped, and what replaces it or why nothing does."""

    key: str
    release: str
    why: str
    value: object = None
    """Only this value was removed (``None``: the key itself)."""


REMOVED: tuple[Removed, ...] = (
    Removed(
        "trainer.use_legacy_worker_impl",
        "0.8.0",
        "every role runs on the engine workers ('deprecate workers, migrate to engines'); no key chooses the "
        "legacy workers any more",
    ),
    Removed(
        f"{ARR}.rollout.mode",
        "0.7.0",
        "the synchronous rollout is gone; every rollout is served asynchronously (the default, async)",
        value="sync",
    ),
)

# Removed keys whose meaning lives on in other keys: (key, value, replacement overrides, release, why).
EXPANDED: tuple[tuple[str, str, tuple[str, ...], str, str], ...] = (
    (
        "trainer.remove_previous_ckpt_in_save",
        "true",
        ("trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1"),
        "0.3.0.post1",
        "keeping only the newest checkpoint is said with the max_*_ckpt_to_keep keys",
    ),
)

# Deprecated global micro batch sizes → per-GPU sizes (the global size divided by the trainer's GPUs).
PER_GPU: tuple[tuple[str, str], ...] = tuple(
    (a.old, a.new) for a in ALIASES if a.new.endswith("_per_gpu") and a.old + "_per_gpu" == a.new
)
MANDATORY_SINCE = {f"{ARR}.rollout.name": "0.6.0"}


@dataclass(frozen=True)
class Change:
    """One thing the upgrade did or reports: kind, the key as written, its new key, line and why."""

    kind: str  # moved | converted | removed | added | default | refused | unknown
    key: str
    detail: str
    line: int | None = None
    new_key: str | None = None
    fix: str | None = None


@dataclass(frozen=True)
class Upgrade:
    """The upgraded override tokens (provenance: original file:line plus the rule) and every change."""

    source: str
    detected: str
    tokens: tuple[OverrideToken, ...]
    changes: tuple[Change, ...]


def token_key(text: str) -> tuple[str, str, str | None]:
    """(prefix of + / ++ / ~, key, value text or None) of one override."""
    stripped = text.lstrip("+~")
    prefix = text[: len(text) - len(stripped)]
    key, sep, value = stripped.partition("=")
    return prefix, key.strip(), value if sep else None


def plan_upgrade(
    tokens: Sequence[OverrideToken],
    source: str,
    detected: str,
    installed: Mapping[str, object],
    layout: Layout | None = None,
    *,
    whole_launch: bool = True,
) -> Upgrade:
    """Map, convert and drop the tokens of a launch written for ``source`` so that the installed verl runs it.

    ``layout`` is what the launch says about its GPUs and sequence parallelism (by default read from the tokens and
    the release's defaults); a global micro batch size is converted only when it is known. ``whole_launch``: the
    tokens are a whole launch (keys that follow others, keys that became mandatory are added), not a part."""
    if source not in RELEASES:
        raise UsageError(
            f"unknown release '{source}'", where="--from", fix="use one of: auto, " + ", ".join(RELEASES)
        )
    moves = moves_after(source)
    out: list[OverrideToken] = []
    changes: list[Change] = []
    layout = layout or read_layout(tokens, history(RELEASES[source]), {}, None)
    for token in tokens:
        result = _upgrade_token(token, source, moves, installed, layout)
        changes.extend(result[1])
        out.extend(result[0])
    if not whole_launch:
        return Upgrade(source, detected, tuple(out), tuple(changes))
    followers, notes = _sp_followers(tokens, out, layout)
    out += followers
    changes += notes
    added, notes = _mandatory(out, source, installed)
    out += added
    changes += notes + _required_now(out)
    return Upgrade(source, detected, tuple(out), tuple(changes))


def moves_after(source: str) -> list[Move]:
    """Every move that took effect after ``source``, oldest first (chains follow one another)."""
    return list(_moves_after(source))


@functools.cache
def _moves_after(source: str) -> tuple[Move, ...]:
    newer = [m for m in (*generated_moves(), *HAND_MOVES) if _newer(m.release, source)]
    return tuple(sorted(newer, key=lambda m: version(m.release)))


def _newer(release: str, source: str) -> bool:
    return version(release) > version(source)


TokenResult = tuple[tuple[OverrideToken, ...], list[Change]]


def _upgrade_token(
    token: OverrideToken, source: str, moves: list[Move], installed: Mapping[str, object], layout: Layout
) -> TokenResult:
    prefix, key, value = token_key(token.text)
    line = token.source.line
    if not key or "=" in key or key.startswith(("preset", "hardware.")) or "/" in key:
        return (token,), []
    steps: list[str] = []
    new = key
    for move in moves:
        if new == move.old:
            steps.append(f"verl {move.release}: {move.evidence}")
            new = move.new
    if new not in installed and key in installed:
        steps, new = [], key  # moved away and back again (e.g. the profiler options between 0.4 and 0.6)
    if _legacy(new) and legacy_reward_key(new) in installed:
        steps.append(_LEGACY_READ)
        new = legacy_reward_key(new)
    for rule in _REMOVALS:
        result = rule(token, new, value, source, line)
        if result is not None:
            return result
    for old, per_gpu in PER_GPU:
        if new == old and value is not None:
            return _per_gpu(token, prefix, old, per_gpu, value, layout, line)
    alias = next((a for a in ALIASES if a.old == new and a.fix == "{new}={value}"), None)
    if alias is not None:
        steps.append(f"deprecated in verl 0.9.1: {alias.why}")
        new = alias.new
    if new == key:
        return (
            _appended(token, key, installed, line) if prefix == "+" and key in installed else ((token,), [])
        )
    if prefix == "+" and new in installed:
        prefix = ""
    rule_text = "; ".join(steps)
    text = f"{prefix}{new}" + (f"={value}" if value is not None else "")
    moved = _retoken(token, text, f"upgraded from {key}: {rule_text}")
    return (moved,), [Change("moved", key, rule_text, line, new)]


def _retoken(token: OverrideToken, text: str, reason: str) -> OverrideToken:
    return OverrideToken(text, replace(token.source, reason=reason))


def _removed(
    token: OverrideToken, key: str, value: str | None, source: str, line: int | None
) -> TokenResult | None:
    for entry in REMOVED:
        if entry.key != key or not _newer(entry.release, source):
            continue
        if entry.value is not None and (value or "").strip("'\"") != entry.value:
            continue
        shown = token.text.lstrip("+~")
        return (), [
            Change("removed", key, f"dropped {shown}: removed in verl {entry.release}; {entry.why}", line)
        ]
    return None


def _vanished(
    token: OverrideToken, key: str, value: str | None, source: str, line: int | None
) -> TokenResult | None:
    """A key of the source release that a later release dropped without a successor we can name."""
    if key not in history(RELEASES[source]) or key in history(TAGS[-1]) or token.text.startswith("+"):
        return None
    later = [series_of(t) for t in TAGS if key not in history(t) and _newer(t, source)]
    gone = later[0] if later else INSTALLED_SERIES
    last = series_of([t for t in TAGS if key in history(t)][-1])
    why = (
        f"removed in verl {gone} (the release history has it up to {last}); no key of later releases carries the same name and default, so it is not "
        "guessed: check verl's release notes for its replacement"
    )
    return (), [Change("removed", key, f"dropped {token.text.lstrip('+~')}: {why}", line)]


def _expanded(
    token: OverrideToken, key: str, value: str | None, source: str, line: int | None
) -> TokenResult | None:
    for old, wanted, news, release, why in EXPANDED:
        if old != key or not _newer(release, source) or (value or "").strip("'\"").lower() != wanted:
            continue
        detail = f"{token.text.lstrip('+~')} -> {' '.join(news)}: removed in verl {series_of(release)}; {why}"
        made = tuple(_retoken(token, new, f"upgraded from {key}: {detail}") for new in news)
        return made, [Change("converted", key, detail, line, " ".join(k.partition("=")[0] for k in news))]
    return None


_REMOVALS: tuple[Callable[[OverrideToken, str, str | None, str, int | None], TokenResult | None], ...] = (
    _expanded,
    _removed,
    _vanished,
)


def _per_gpu(
    token: OverrideToken, prefix: str, old: str, new: str, value: str, layout: Layout, line: int | None
) -> TokenResult:
    number = plain_int(value)
    ranks, label, how = layout.data_parallel(old)
    if number is None or ranks is None:
        why = "its value is not a plain integer" if number is None else how
        detail = (
            f"{old}={value} is a global micro batch size, and {why}: set {new} yourself "
            "(global size / data-parallel ranks, = GPUs / Ulysses SP)"
        )
        return (token,), [Change("refused", old, detail, line, new)]
    if number % ranks:
        detail = (
            f"{old}={number} is a global micro batch size that does not split over {label} "
            f"({number} / {ranks} is not whole; {how}): choose {new} yourself"
        )
        return (token,), [Change("refused", old, detail, line, new)]
    per = number // ranks
    detail = f"global micro batch {number} / {label} = {per} per GPU ({how}; global sizes are deprecated in verl 0.9.1)"
    text = f"{prefix.replace('+', '')}{new}={per}"
    return (_retoken(token, text, f"upgraded from {old}={number}: {detail}"),), [
        Change("converted", old, detail, line, new)
    ]


def _appended(
    token: OverrideToken, key: str, installed: Mapping[str, object], line: int | None
) -> TokenResult:
    """``+key=value`` for a key verl has: Hydra refuses to append it, so the value is applied as a plain override."""
    text = token.text[1:]
    detail = (
        f"'+' dropped: verl 0.9.1 has {key} (default {format_value(installed[key])}), and Hydra refuses to append "
        "a key that exists; the value is applied as a plain override"
    )
    return (_retoken(token, text, f"upgraded from {token.text}: {detail}"),), [
        Change("converted", key, detail, line)
    ]


def _sp_followers(
    tokens: Sequence[OverrideToken], out: Sequence[OverrideToken], layout: Layout
) -> tuple[list[OverrideToken], list[Change]]:
    """The reference model ran with the actor's Ulysses SP (its key interpolated the actor's); once the actor's
    value moves to its new key, the reference model's is set explicitly so that it does not fall back to 1."""
    before = {token_key(t.text)[1] for t in tokens}
    after = {token_key(t.text)[1] for t in out}
    sp = layout.actor_sp.value
    if (
        ACTOR_SP[0] not in before
        or ACTOR_SP[0] in after
        or any(k in before for k in REF_SP)
        or not sp
        or sp <= 1
    ):
        return [], []
    base = next(t for t in tokens if token_key(t.text)[1] == ACTOR_SP[0])
    why = (
        f"the reference model followed the actor's Ulysses SP through {REF_SP[0]} "
        f"(${{oc.select:{ACTOR_SP[0]},1}}); with the actor's value moved to {ACTOR_SP[1]} it would fall back to 1"
    )
    text = f"{REF_SP[1]}={sp}"
    token = OverrideToken(text, replace(base.source, reason=f"added by upgrade: {why}"))
    return [token], [Change("added", REF_SP[1], f"set {text}: {why}", base.source.line, REF_SP[1])]


def _mandatory(
    tokens: list[OverrideToken], source: str, installed: Mapping[str, object]
) -> tuple[list[OverrideToken], list[Change]]:
    """Keys that became mandatory after ``source``: the old default is set explicitly."""
    set_keys = {token_key(t.text)[1] for t in tokens}
    added: list[OverrideToken] = []
    changes: list[Change] = []
    for key, since in MANDATORY_SINCE.items():
        old = history(RELEASES[source]).get(key)
        if key in set_keys or not _newer(since, source) or old in (None, "???"):
            continue
        why = (
            f"mandatory since verl {since}; the launch relied on verl {source}'s default {format_value(old)}"
        )
        text = f"{key}={override_value(old)}"
        base = tokens[-1].source if tokens else None
        source_of = replace(base, line=None, raw=None, reason=f"added by upgrade: {why}") if base else None
        if source_of is not None:
            added.append(OverrideToken(text, source_of))
            changes.append(Change("added", key, f"set {text}: {why}", None, key))
    return added, changes


def _required_now(tokens: Sequence[OverrideToken]) -> list[Change]:
    """Keys verl 0.9.1 requires once a section is switched on, with no old key to take the value from."""
    values = {token_key(t.text)[1]: token_key(t.text)[2] for t in tokens}
    out: list[Change] = []
    for key, switch in REQUIRED_WHEN.items():
        if key in values or (values.get(switch) or "").strip("'\"").lower() != "true":
            continue
        detail = (
            f"{switch}=true: verl 0.9.1 serves the reward model with an inference engine and requires {key}, which "
            f"no earlier key of the launch says; set {key}={REQUIRED_HINTS.get(key, '...')} yourself"
        )
        out.append(Change("refused", key, detail, None, key))
    return out


def current_key(key: str, moves: Sequence[Move], installed: Mapping[str, object] | None = None) -> str:
    """Where an old key lives now: every later move followed (unless the chain leaves the installed verl's keys
    while the key itself is still there), then a deprecated spelling replaced."""
    moved = key
    for move in moves:
        if moved == move.old:
            moved = move.new
    if installed is not None and moved not in installed and key in installed:
        moved = key
    return next((a.new for a in ALIASES if a.old == moved and a.fix == "{new}={value}"), moved)


def _legacy(key: str) -> bool:
    """Top-level legacy sections that the installed verl accepts and ignores."""
    return key.split(".", 1)[0] in ("reward_model", "custom_reward_function", "sandbox_fusion")


def override_value(value: object) -> str:
    """A value as an override writes it: bare when Hydra reads it back as the same string, else quoted."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", value) and value not in _WORDS:
        return value
    return hydra_literal(value)


_WORDS = frozenset({"true", "false", "null", "True", "False", "None", "nan", "inf"})

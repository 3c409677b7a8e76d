"""How verl 0.9.1 reads a value: values it takes as the same, keys a run does not read, values it refuses only once
the run has started. Each entry cites the code it comes from; tests run that code (tests/test_upgrade_readings.py).

The upgrade's advice rests on these: a "keep the old behaviour" line is offered only when the value changes what
the run does (not read alike, read at all) and nothing refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from verl_safe_launch.audit.aliases import IGNORED, legacy_reward_key, matches
from verl_safe_launch.audit.history import RELEASES
from verl_safe_launch.audit.parallel import ACTOR_SP, CRITIC_SP, REF_SP
from verl_safe_launch.audit.upgrade import PER_GPU, current_key, moves_after
from verl_safe_launch.config_view import ARR, ConfigView, ref_in_actor
from verl_safe_launch.inputs import engine_load_formats, engine_version, registered_names

When = Callable[[ConfigView], bool]
GLOBAL_SIZES = frozenset(old for old, _ in PER_GPU)


def _always(view: ConfigView) -> bool:
    return True


def _fsdp_actor(view: ConfigView) -> bool:
    return view.get(f"{ARR}.actor.strategy") in ("fsdp", "fsdp2")


def _fsdp_critic(view: ConfigView) -> bool:
    return view.get("critic.strategy") in ("fsdp", "fsdp2")


@dataclass(frozen=True)
class Alike:
    """Values of one key that verl reads the same way (``pattern``: a key, or ``prefix.*``)."""

    pattern: str
    values: tuple[object, ...]
    why: str
    when: When = _always


ALIKE: tuple[Alike, ...] = (
    Alike(
        f"{ARR}.actor.optim.min_lr_ratio",
        (None, 0.0),
        "verl 0.9.1's FSDP engine passes it to get_cosine_schedule_with_warmup, which reads null as 0.0 "
        "(verl/utils/torch_functional.py), and the constant schedule does not read it",
        _fsdp_actor,
    ),
    Alike(
        "critic.optim.min_lr_ratio",
        (None, 0.0),
        "verl 0.9.1's FSDP engine passes it to get_cosine_schedule_with_warmup, which reads null as 0.0 "
        "(verl/utils/torch_functional.py), and the constant schedule does not read it",
        _fsdp_critic,
    ),
    Alike(
        "trainer.resume_from_path",
        (None, False),
        "both say 'no path': verl 0.9.1 reads it only with resume_mode=resume_path, where it must be a path "
        "(RayPPOTrainer._load_checkpoint)",
    ),
    Alike(
        f"{ARR}.rollout.load_format",
        ("dummy_dtensor", "dummy_hf", "dummy_megatron", "dummy"),
        "old releases handed vLLM 'dummy' for every dummy_* format (random weights, then the actor's weights synced "
        "in: verl/third_party/vllm/*/model_loader.py); verl 0.9.1 does the same with 'dummy'",
    ),
)


@dataclass(frozen=True)
class Gate:
    """Keys below ``prefix`` that a run reads only when ``reads`` holds."""

    prefix: str
    reads: When
    why: str


def _switch(key: str, want: object = True) -> When:
    def reads(view: ConfigView) -> bool:
        return bool(view.get(key) == want)

    return reads


def _profiled(role: str) -> When:
    def reads(view: ConfigView) -> bool:
        return bool(view.get("global_profiler.tool")) and view.get(f"{role}.profiler.enable") is True

    return reads


GATES: tuple[Gate, ...] = (
    Gate("algorithm.filter_groups.", _switch("algorithm.filter_groups.enable"), "group filtering is off"),
    Gate("reward.reward_model.", _switch("reward.reward_model.enable"), "no reward model is served"),
    Gate(
        "trainer.resume_from_path",
        _switch("trainer.resume_mode", "resume_path"),
        "resume_mode is not resume_path",
    ),
    *(
        Gate(f"{role}.profiler.", _profiled(role), "the profiler is off")
        for role in (f"{ARR}.actor", f"{ARR}.ref", f"{ARR}.rollout", "critic")
    ),
)


FALLBACK: Mapping[str, str] = {
    f"{role}.model.{name}": f"{role}.model.path"
    for role in (ARR, "critic")
    for name in ("tokenizer_path", "hf_config_path")
}
"""Keys a null of which verl 0.9.1 reads as another key's value: HFModelConfig.__post_init__ takes the model's
path for a null tokenizer_path or hf_config_path (verl/workers/config/model.py)."""

NOT_READ: Mapping[str, str] = {
    "data.return_raw_chat": (
        "verl 0.9.1's RLHFDataset stores it and never reads it again: every item carries the raw chat "
        "(raw_prompt), which the agent loop renders (verl/utils/dataset/rl_dataset.py)"
    ),
}
"""Keys verl 0.9.1 accepts and never reads (not warned about by ``check``: setting them does no harm)."""


def alike(key: str, a: object, b: object, view: ConfigView | None = None) -> Alike | None:
    """The entry saying verl reads ``a`` and ``b`` of ``key`` the same way, if there is one."""
    for entry in ALIKE:
        listed = _listed(a, entry.values) and _listed(b, entry.values)
        if matches(entry.pattern, key) and listed and (view is None or entry.when(view)):
            return entry
    return None


def _listed(value: object, values: tuple[object, ...]) -> bool:
    return any(same_value(value, v) for v in values)


def same_value(a: object, b: object) -> bool:
    """Equal as YAML values: ``1`` and ``1.0`` are, ``true`` and ``1`` are not; a YAML 1.1 number string
    (``1e-6``) is its number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y or (math.isnan(x) and math.isnan(y))
    return a == b


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def equivalent_values(key: str, a: object, b: object, view: ConfigView | None = None) -> bool:
    """True when verl 0.9.1 reads ``a`` and ``b`` of ``key`` the same way."""
    if same_value(a, b) or alike(key, a, b, view) is not None:
        return True
    other = FALLBACK.get(key)
    if other is None or view is None or (a is not None and b is not None):
        return False
    return same_value(a if b is None else b, view.get(other))


def global_size(key: str) -> bool:
    """True for a deprecated global micro batch size (verl 0.9.1 reads per-GPU sizes; the upgrade converts a
    global size the launch sets, and one left at its default follows its per-GPU key)."""
    return key in GLOBAL_SIZES


def unread_because(key: str, view: ConfigView) -> str | None:
    """Why the run described by ``view`` does not read ``key`` (None: it does)."""
    if key.startswith("critic.") and not _critic(view):
        return "the run has no critic"
    if key.startswith(f"{ARR}.ref.") and not _reference(view, key):
        return "the run has no reference model"
    for gate in GATES:
        if key.startswith(gate.prefix) and not gate.reads(view):
            return gate.why
    if key in NOT_READ:
        return NOT_READ[key]
    value = view.get(key)
    for entry in IGNORED:
        if matches(entry.pattern, key) and entry.when(value, view):
            return f"verl 0.9.1 does not act on it: {entry.why}"
    return None


def runs_read(key: str, view: ConfigView) -> bool:
    """True when the run described by ``view`` reads ``key``."""
    return unread_because(key, view) is None


def _critic(view: ConfigView) -> bool:
    enable = view.get("critic.enable")
    return bool(enable) if enable is not None else view.get("algorithm.adv_estimator") == "gae"


def _reference(view: ConfigView, key: str) -> bool:
    if key.startswith(f"{ARR}.ref.log_prob") and ref_in_actor(view):
        return False
    return bool(view.get(f"{ARR}.actor.use_kl_loss") or view.get("algorithm.use_kl_in_reward"))


REGISTERED = {
    "algorithm.adv_estimator": "advantage estimator",
    "reward.reward_manager.name": "reward manager",
    f"{ARR}.rollout.name": "rollout",
    f"{ARR}.actor.policy_loss.loss_mode": "policy loss",
}


def _hdfs(value: object, view: ConfigView) -> str | None:
    if value is None or view.get("trainer.resume_mode") == "disable":
        return None
    return (
        "verl 0.9.1 raises NotImplementedError('load from hdfs is not implemented yet') when it looks for a "
        "checkpoint to resume from (RayPPOTrainer._load_checkpoint; resume_mode is not disable)"
    )


RUNTIME: Mapping[str, Callable[[object, ConfigView], str | None]] = {"trainer.default_hdfs_dir": _hdfs}
"""Values verl 0.9.1 accepts in validate_config and refuses once the run has started."""


def runtime_refusal(key: str, value: object, view: ConfigView) -> str | None:
    """Why verl 0.9.1, or the engine it hands the value to, refuses ``key=value`` at run time (None: nothing
    does): names its registries lack, load formats the rollout engine lacks, the values of ``RUNTIME``."""
    if key == f"{ARR}.rollout.load_format" and isinstance(value, str):
        engine = str(view.get(f"{ARR}.rollout.name"))
        formats = engine_load_formats().get(engine)
        if formats is not None and value.lower() not in formats:
            return (
                f"verl 0.9.1 hands it to {engine} {engine_version(engine)}, which has no load format {value!r} "
                f"(it has {', '.join(sorted(formats))})"
            )
    registry = REGISTERED.get(key)
    if registry is not None and isinstance(value, str):
        names = registered_names().get(registry, frozenset())
        if names and value not in names:
            return f"verl 0.9.1 registers no {registry} {value!r}"
    check = RUNTIME.get(key)
    return check(value, view) if check is not None else None


SP_KEYS = {keys[0]: keys[1] for keys in (ACTOR_SP, REF_SP, CRITIC_SP)}
"""Each role's Ulysses SP: the old key, and the key verl 0.9.1 reads (the upgrade sets the reference's explicitly)."""


def new_key_of(key: str, source: str, installed: Mapping[str, object] | None = None) -> str:
    """Where a key of release ``source`` lives in verl 0.9.1: every move since followed, a deprecated spelling
    replaced, a legacy top-level reward key read where 0.9.1 reads it."""
    moved = current_key(key, moves_after(source) if source in RELEASES else [], installed)
    moved = SP_KEYS.get(moved, moved)
    if moved.split(".", 1)[0] in ("reward_model", "custom_reward_function", "sandbox_fusion"):
        return legacy_reward_key(moved)
    return moved

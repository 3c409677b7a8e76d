"""Names verl looks up in a registry (advantage estimators, policy losses, reward managers, agent loops)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

from verl_safe_launch.config_view import ARR, ConfigView, format_value, is_missing
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule, Severity
from verl_safe_launch.inputs import (
    REGISTRIES,
    Registry,
    engine_load_formats,
    engine_version,
    group_estimators,
    group_of_one_raises,
    pinned_by,
    registered_names,
    verl_release,
)
from verl_safe_launch.rules.fixes import KeyFix
from verl_safe_launch.rules.kit import Draft, check, kv


def _custom_reward(view: ConfigView) -> bool:
    """A reward manager from a module, or a custom reward file verl imports (it may register one itself)."""
    if view.get("reward.reward_manager.source", "register") != "register":
        return True
    return any(view.get(k) for k in ("custom_reward_function.path", "reward.custom_reward_function.path"))


def _custom_agent_loops(view: ConfigView) -> bool:
    return bool(view.get(f"{ARR}.rollout.agent.agent_loop_config_path"))


CUSTOM: dict[str, Callable[[ConfigView], bool]] = {
    "reward manager": _custom_reward,
    "agent loop": _custom_agent_loops,
}
"""When a registry's value may name something the user registers outside verl, its check does not apply."""
OWN_RULE = frozenset({"rollout"})
"""Registries judged by a rule of their own (``verl-rollout-name``)."""


def unregistered(view: ConfigView, registry: Registry, names: frozenset[str]) -> list[Draft]:
    """A draft per key of ``registry`` set to a name it does not hold."""
    drafts: list[Draft] = []
    custom = CUSTOM.get(registry.name)
    if not names or (custom is not None and custom(view)):
        return drafts
    for key in registry.keys:
        value = view.get(key)
        if not isinstance(value, str) or is_missing(value) or value in names:
            continue
        release = verl_release().name
        msg = (
            f"{key}={format_value(value)} is not a registered {registry.name} in {release} "
            f"(it has {', '.join(sorted(names))}); it looks it up only once the run has started"
        )
        close = difflib.get_close_matches(value, sorted(names), n=3, cutoff=0.6)
        fix = None if close else f"{key}={min(names)} (or another registered {registry.name})"
        drafts.append(Draft((key,), msg, (KeyFix(key, tuple(close)),) if close else (), fix_text=fix))
    return drafts


@check("verl-registry-name", "names verl looks up in its registries are registered in the verl in use")
def registry_names(ctx: RuleContext) -> list[Draft]:
    """``get_adv_estimator_fn``, ``get_policy_loss_fn``, ``get_reward_manager_cls``, the agent-loop registry."""
    found = registered_names()
    drafts: list[Draft] = []
    for registry in REGISTRIES:
        if registry.name not in OWN_RULE:
            drafts.extend(unregistered(ctx.view, registry, found.get(registry.name, frozenset())))
    return drafts


ESTIMATOR = "algorithm.adv_estimator"
GROUP_SIZE = f"{ARR}.rollout.n"


@check(
    "verl-group-estimator-n",
    "a group advantage estimator (GRPO, RLOO...) gets more than one response per prompt",
    Severity.WARNING,
)
def group_of_one(ctx: RuleContext) -> list[Draft]:
    """The estimators whose function takes the group ``index`` (read from the verl in use) compare the responses
    to one prompt; with ``rollout.n=1`` there is no group to compare. verl runs it (the advantage becomes the raw
    reward or 0, by estimator), so this is a warning; an estimator whose function raises on a group of one
    (``grpo_passk``, read from the verl in use) stops the first step: an error. A fork that carries the group size in
    a key of its own (``rollout.n_agent``, ``agent_grpo.n``) is not judged on ``rollout.n``, nor is a run that only
    validates (``validation_only``) or on-policy distillation without task rewards, whose loss does not read the
    advantages (``distillation_only``)."""
    view = ctx.view
    estimator, n = view.get(ESTIMATOR), view.get(GROUP_SIZE)
    if not isinstance(estimator, str) or estimator not in group_estimators() or n != 1:
        return []
    if other_group_sizes(view) or validation_only(view):
        return []
    release = verl_release().name
    said = (
        f"{kv(view, ESTIMATOR)} compares the responses to one prompt with each other, and {kv(view, GROUP_SIZE)} "
        "gives each prompt one response"
    )
    if estimator in group_of_one_raises():
        msg = f"{said}: {release}'s {estimator} raises on a group of one when it computes the first step's advantages"
        return [Draft((ESTIMATOR, GROUP_SIZE), msg, (KeyFix(GROUP_SIZE, (5,)),), severity=Severity.ERROR)]
    if distillation_only(view):
        return []
    msg = (
        f"{said}: there is no group to compare, and {release} runs it with the advantage set to the raw reward (a "
        "group of one gets the baseline 0: grpo, rloo) or to 0 (the baseline is the reward itself: rloo_vectorized), "
        f"so the run is not the {estimator} its name says"
    )
    fixes = (KeyFix(GROUP_SIZE, (5,)), KeyFix(ESTIMATOR, ("gae",)))
    return [Draft((ESTIMATOR, GROUP_SIZE), msg, fixes)]


def validation_only(view: ConfigView) -> bool:
    """``trainer.val_only`` with the validation before training on (its default): verl's ``fit`` validates and
    returns before its first training step, so no advantage is ever computed."""
    return view.get("trainer.val_only") is True and view.get("trainer.val_before_train") is not False


DISTILLATION = "distillation.enabled"
TASK_REWARDS = "distillation.distillation_loss.use_task_rewards"


def distillation_only(view: ConfigView) -> bool:
    """On-policy distillation without task rewards: verl (0.8.0 on) sets the policy loss, the only reader of the
    estimator's advantages, to 0 and trains on the distillation loss alone (``trainer/distillation/losses.py``:
    ``if not use_task_rewards: policy_loss = 0.0``), so the group size does not matter; verl's own distillation
    examples run GRPO with one response per prompt."""
    return view.get(DISTILLATION) is True and view.get(TASK_REWARDS) is False


GROUP_LEAF = re.compile(r"n|n_(agent|samples?|repeats?|responses?|rollouts?|generations?)")


def other_group_sizes(view: ConfigView) -> list[str]:
    """Keys other than ``rollout.n`` (and the validation sampling's ``n``) that can carry a group size: a leaf named
    ``n`` or ``n_agent``, ``n_samples``... holding an integer above 1, as forks name theirs (``rollout.n_agent``,
    ``agent_grpo.n``)."""
    found = []
    for key in view.values:
        leaf = key.rsplit(".", 1)[-1]
        if key == GROUP_SIZE or ".val_kwargs." in f".{key}." or not GROUP_LEAF.fullmatch(leaf):
            continue
        value = view.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            found.append(key)
    return found


LOAD_FORMAT = f"{ARR}.rollout.load_format"


@check("verl-load-format", "rollout.load_format is a load format of the engine verl passes it to")
def load_format(ctx: RuleContext) -> list[Draft]:
    """verl 0.9.1 hands ``load_format`` to vLLM or SGLang unchanged; their loader lookup raises for an unknown
    format when the rollout server starts. The formats are read from the engine versions verl pins."""
    view = ctx.view
    engine, value = view.get(f"{ARR}.rollout.name"), view.get(LOAD_FORMAT)
    if verl_release().name != pinned_by() or not isinstance(engine, str) or not isinstance(value, str):
        return []
    formats = engine_load_formats().get(engine)
    if formats is None or value.lower() in formats:
        return []
    msg = (
        f"{kv(view, LOAD_FORMAT)} is not a load format of {engine} {engine_version(engine)} (the version "
        f"{pinned_by()} pins; it has {', '.join(sorted(formats))}): the rollout server stops when it starts"
    )
    close = difflib.get_close_matches(value, sorted(formats), n=3, cutoff=0.6) or ["dummy"]
    return [Draft((LOAD_FORMAT,), msg, (KeyFix(LOAD_FORMAT, tuple(close)),))]


RULES: tuple[Rule[RuleContext], ...] = (registry_names, group_of_one, load_format)

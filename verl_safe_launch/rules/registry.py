"""Names verl looks up in a registry (advantage estimators, policy losses, reward managers, agent loops)."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from verl_safe_launch.config_view import ARR, ConfigView, format_value, is_missing
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import REGISTRIES, Registry, registered_names, verl_release
from verl_safe_launch.rules.fixes import KeyFix
from verl_safe_launch.rules.kit import Draft, check


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


RULES: tuple[Rule[RuleContext], ...] = (registry_names,)

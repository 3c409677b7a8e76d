"""The audit's rule table and the read-only context its rules see (writes, view, verl's schema facts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from verl_safe_launch.compose import Composed
from verl_safe_launch.config_view import ARR, ConfigView, ref_in_actor
from verl_safe_launch.findings import Finding, Rule, Severity
from verl_safe_launch.inputs import KeyFacts, key_facts, verl_prefix
from verl_safe_launch.provenance import Layer, Source, Write, writes_by_key


@dataclass(frozen=True)
class AuditContext:
    """What every audit rule reads: the composition, verl's schema facts, and the explicit writes per key."""

    composed: Composed
    facts: KeyFacts
    explicit: dict[str, list[Write]]
    effective: tuple[Write, ...] = ()

    @property
    def view(self) -> ConfigView:
        """The composed config view."""
        return self.composed.view

    @classmethod
    def build(cls, composed: Composed) -> AuditContext:
        """Index the writes of anything but verl's defaults, per key, in order."""
        after_verl = composed.writes[verl_prefix(composed.writes) :]
        explicit = writes_by_key(w for w in after_verl if w.source.layer is not Layer.VERL)
        effective = tuple(
            w[-1] for w in explicit.values() if w[-1].source.layer in (Layer.FILE, Layer.SCRIPT, Layer.CLI)
        )
        return cls(
            composed, key_facts(composed.writes), explicit, tuple(w for w in effective if not w.delete)
        )

    def last(self, key: str) -> Write | None:
        """The last explicit write of ``key`` (the one that took effect), if any."""
        writes = self.explicit.get(key)
        return writes[-1] if writes else None

    def user_writes(self) -> tuple[Write, ...]:
        """The effective user write of every explicitly set key (presets and hardware adaptation excluded)."""
        return self.effective

    def role_used(self, key: str, *, validated: bool = False) -> bool:
        """False for critic/ref keys when this run has no critic/reference model.

        With LoRA no worker reads the reference's log-prob keys, but validate_config still checks them
        (``validated``: whether validate_config reads the key).
        """
        view = self.view
        if key.startswith("critic."):
            enable = view.get("critic.enable")
            return bool(enable) if enable is not None else view.get("algorithm.adv_estimator") == "gae"
        if key.startswith(f"{ARR}.ref.log_prob") and ref_in_actor(view) and not validated:
            return False  # with LoRA the actor computes the reference log-probs and never reads these
        if key.startswith(f"{ARR}.ref."):
            return bool(view.get(f"{ARR}.actor.use_kl_loss") or view.get("algorithm.use_kl_in_reward"))
        return True


AuditCheck = Callable[[AuditContext], list[Finding]]

PINNED = ("since:0.9.0",)
"""Needs of a rule whose tables were written from verl 0.9's source (deprecated spellings, ignored keys)."""
SCHEMA: tuple[str, ...] = ()
"""Needs of a rule that reads verl's dataclass schema: none, the schema is read from the verl in use."""


def audit_rule(
    rule_id: str, description: str, needs: tuple[str, ...] = ()
) -> Callable[[AuditCheck], Rule[AuditContext]]:
    """Make an audit rule of a check (the module lists it in its ``RULES`` tuple; ``needs``: see ``Rule``)."""

    def make(fn: AuditCheck) -> Rule[AuditContext]:
        return Rule(rule_id, description, Severity.ERROR, fn, needs)

    return make


def short(source: Source) -> str:
    """A compact position: ``run.sh:12``, ``argument 3``, ``preset medium``."""
    if source.layer is Layer.CLI and source.arg_index is not None:
        return f"argument {source.arg_index}"
    if source.layer is Layer.PRESET:
        return f"preset {source.name}" + (f" ({source.file}:{source.line})" if source.line else "")
    if source.file:
        return f"{source.file}:{source.line}" if source.line else source.file
    return source.describe()


def position(source: Source) -> str:
    """The position inside one layer: ``line 12`` or ``argument 3``."""
    if source.arg_index is not None:
        return f"argument {source.arg_index}"
    if source.line is not None:
        return f"line {source.line}"
    return source.describe()


def finding(
    rule_id: str,
    severity: Severity,
    keys: tuple[str, ...],
    message: str,
    fix: str | None,
    writes: list[Write] | tuple[Write, ...] = (),
) -> Finding:
    """A finding whose sources are the given writes."""
    return Finding(rule_id, severity, keys, message, fix, tuple((w.key, w.value, w.source) for w in writes))

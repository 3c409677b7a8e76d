"""What the rule modules share: draft findings, registration with the rule id filled in, input checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from verl_safe_launch.config_view import ConfigView, format_value
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Finding, Rule, Severity
from verl_safe_launch.inputs import verl_check, verl_release
from verl_safe_launch.provenance import Source
from verl_safe_launch.rules.fixes import KeyFix, render_fix
from verl_safe_launch.rules.plan import BatchPlan, batch_plan, pos_int


@dataclass(frozen=True)
class Draft:
    """A finding before registration fills in its rule id: keys, message, fixes, severity override."""

    keys: tuple[str, ...]
    message: str
    fixes: tuple[KeyFix | None, ...] = ()
    severity: Severity | None = None
    fix_text: str | None = None
    reads: tuple[str, ...] = ()
    """Keys the arithmetic read besides ``keys`` (cited, not shown): an unread value of one could change it."""

    def finding(self, rule_id: str, severity: Severity, view: ConfigView) -> Finding:
        """The finding, with the value and origin of every key involved."""
        fix = render_fix(self.fixes) or self.fix_text
        reads = tuple(k for k in dict.fromkeys(self.reads) if k not in self.keys)
        severity = self.severity or severity
        return Finding(rule_id, severity, self.keys, self.message, fix, sources(view, self.keys), reads)


DraftFn = Callable[[RuleContext], Iterable[Draft]]


def check(
    rule_id: str, description: str, severity: Severity = Severity.ERROR, needs: tuple[str, ...] = ()
) -> Callable[[DraftFn], Rule[RuleContext]]:
    """Make a rule of a function returning drafts; the rule turns them into findings (``needs``: see ``Rule``)."""

    def make(fn: DraftFn) -> Rule[RuleContext]:
        def run(ctx: RuleContext) -> list[Finding]:
            return [d.finding(rule_id, severity, ctx.view) for d in fn(ctx)]

        run.__name__ = run.__qualname__ = fn.__name__
        run.__doc__, run.__module__ = fn.__doc__, fn.__module__
        return Rule(rule_id, description, severity, run, needs)

    return make


def stops(check_name: str) -> str:
    """``verl 0.8.0 stops here in ActorConfig.validate``: the release judged, and where its check is."""
    site = verl_check(check_name)
    where = f" in {site.function}" if site is not None and site.function else ""
    return f"{verl_release().name} stops here{where}"


def late() -> str:
    """``verl 0.8.0 only finds out at the first training step``."""
    return f"{verl_release().name} only finds out at the first training step"


def sources(view: ConfigView, keys: Sequence[str]) -> tuple[tuple[str, object, Source], ...]:
    """(key, value, source) for each key the view knows."""
    out: list[tuple[str, object, Source]] = []
    for key in keys:
        prov = view.prov(key)
        if prov is not None:
            out.append((key, view.get(key), prov.source))
    return tuple(out)


def skipped(keys: Sequence[str], why: str) -> Draft:
    """An info finding: the rule could not run, and why."""
    return Draft(tuple(keys), f"skipped: {why}", severity=Severity.INFO)


def not_positive(view: ConfigView, keys: Sequence[str]) -> list[Draft]:
    """A skip note when any of ``keys`` is set to something other than a positive integer."""
    bad = [k for k in keys if view.get(k) is not None and pos_int(view.get(k)) is None]
    if not bad:
        return []
    shown = ", ".join(f"{k}={format_value(view.get(k))}" for k in bad)
    return [skipped(bad, f"{shown} is not a positive integer")]


def kv(view: ConfigView, key: str) -> str:
    """``key=value`` for a message."""
    return f"{key}={format_value(view.get(key))}"


_LAST_PLAN: list[tuple[ConfigView, BatchPlan]] = []


def plan(ctx: RuleContext) -> BatchPlan:
    """The batch arithmetic of the context's config, worked out once for the rules that read the same view.

    A view never changes (a changed config is a new view), so the plan of the last view asked for is kept; the
    keys it read were recorded on that view the first time.
    """
    if _LAST_PLAN and _LAST_PLAN[0][0] is ctx.view:
        return _LAST_PLAN[0][1]
    found = batch_plan(ctx.view)
    _LAST_PLAN[:] = [(ctx.view, found)]
    return found


def is_true(view: ConfigView, key: str) -> bool:
    """True only for a real boolean true."""
    return view.get(key) is True

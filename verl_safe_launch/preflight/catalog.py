"""The rule table with what each rule's check needs of verl: the rows ``rules``, ``explain RULE``, SARIF and
docs/rules/ are made from."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.audit import AUDIT_RULES
from verl_safe_launch.data.rulebook import RuleInfo, rule_book
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import describe_need
from verl_safe_launch.rules import RULES


@dataclass(frozen=True)
class Catalogued:
    """A row of the rule table and the needs its check declares (``since:0.9.0``, ``config:trainer.v1``)."""

    info: RuleInfo
    needs: tuple[str, ...] = ()

    @property
    def since(self) -> str | None:
        """The first verl release judged: a ``since:`` need, else the row's ``since``; None for every release."""
        found = [need.partition(":")[2] for need in self.needs if need.startswith("since:")]
        return found[0] if found else self.info.since

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form of ``rules --format json``."""
        info = self.info
        return {
            "id": info.id,
            "severity": info.severity,
            "also": list(info.also),
            "group": info.group,
            "checks": info.checks,
            "since": self.since,
            "needs": [describe_need(need) for need in self.needs],
            "fix": info.fix,
            "url": info.url,
            "example": info.example.argv() if info.example else None,
        }


@functools.cache
def rule_catalog() -> tuple[Catalogued, ...]:
    """Every rule the tool reports, in the table's order, with its check's needs."""
    table: list[Rule[Any]] = [*RULES, *AUDIT_RULES]
    needs = {rule.rule_id: rule.needs for rule in table}
    return tuple(Catalogued(info, needs.get(info.id, ())) for info in rule_book().rules)


def catalogued(rule_id: str) -> Catalogued | None:
    """The catalog row of ``rule_id``."""
    return next((row for row in rule_catalog() if row.info.id == rule_id), None)


__all__ = ["Catalogued", "catalogued", "rule_catalog"]

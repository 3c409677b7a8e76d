"""The rule table (``rules.yaml``): one row per rule id the tool can report, read once.

``verl-safe-launch rules``, ``explain RULE``, the SARIF rule metadata and ``docs/rules/`` are all made from these
rows. A row's fields are optional beyond ``id``, ``group``, ``severity``, ``checks`` and ``fix``, so a field can be
added to the table without touching the rows that do not need it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

SEVERITIES = ("error", "warning", "info")
DOCS_URL_ENV = "VSL_DOCS_URL"
"""Overrides where the docs are published (a fork's or a company's own copy of the site)."""


def docs_url() -> str:
    """Where the docs are published, ending in ``/``: ``$VSL_DOCS_URL``, else the package's ``Documentation``
    project URL (``[project.urls]`` of pyproject.toml); the rule pages are under ``rules/`` there."""
    url = os.environ.get(DOCS_URL_ENV, "").strip() or project_docs_url()
    return url if not url or url.endswith("/") else url + "/"


@functools.cache
def project_docs_url() -> str:
    """The ``Documentation`` URL of the installed package's metadata ("" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        entries = metadata("verl-safe-launch").get_all("Project-URL") or []
    except PackageNotFoundError:
        return ""
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "documentation":
            return str(url).strip()
    return ""


@dataclass(frozen=True)
class Example:
    """What triggers a rule: ``check`` arguments, or an ``audit`` of ``script`` (``args`` after ``--``)."""

    check: tuple[str, ...] = ()
    script: str | None = None
    args: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    crlf: bool = False
    """The script is written with Windows line endings."""

    @property
    def verb(self) -> str:
        """``audit`` for a script, else ``check``."""
        return "audit" if self.script is not None else "check"

    def argv(self, script_name: str = "run.sh") -> list[str]:
        """The command line that replays the example (after ``verl-safe-launch``)."""
        if self.script is not None:
            return ["audit", script_name, *(["--", *self.args] if self.args else [])]
        return ["check", *self.check]


@dataclass(frozen=True)
class RuleInfo:
    """One row: the id, its docs page (``group``), severities, what it checks, the fix's shape, its example."""

    id: str
    group: str
    severity: str
    checks: str
    fix: str
    also: tuple[str, ...] = ()
    since: str | None = None
    """The first verl release the rule judges; None: every release the tool reads (see also ``needs`` of the
    rule's check, which the catalog adds)."""
    example: Example | None = None
    replayed_by: str | None = None
    """The test that reaches the rule where no command can (a live Ray cluster, a real parquet file)."""
    unreachable: str | None = None
    """Why no input reaches the rule today (a fallback id)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Fields of the row this version does not know; kept, so the table can grow ahead of the code."""

    @property
    def page(self) -> str:
        """The docs page of the rule, relative to docs/: ``rules/overrides.md``."""
        return f"rules/{self.group}.md"

    @property
    def url(self) -> str:
        """The rule's address on the docs site (see ``docs_url``)."""
        return f"{docs_url()}rules/{self.group}/#{self.id}"


@dataclass(frozen=True)
class RuleBook:
    """The whole table: the rows in order, the pages' titles and the shared example arguments."""

    rules: tuple[RuleInfo, ...]
    groups: dict[str, str]
    bases: dict[str, tuple[str, ...]]

    def get(self, rule_id: str) -> RuleInfo | None:
        """The row of ``rule_id``, if the table has one."""
        return self.by_id.get(rule_id)

    @functools.cached_property
    def by_id(self) -> dict[str, RuleInfo]:
        """Rows by id."""
        return {row.id: row for row in self.rules}


@functools.cache
def rule_book() -> RuleBook:
    """The rule table shipped with the package (read once per process)."""
    import yaml

    text = resources.files("verl_safe_launch.data").joinpath("rules.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    bases = {name: tuple(str(a) for a in args) for name, args in data.get("bases", {}).items()}
    rows = tuple(_row(item, bases) for item in data["rules"])
    return RuleBook(rows, dict(data["groups"]), bases)


_KNOWN = frozenset({"id", "group", "severity", "also", "checks", "fix", "since", "example", "replayed_by"})


def _row(item: dict[str, Any], bases: dict[str, tuple[str, ...]]) -> RuleInfo:
    example = item.get("example")
    return RuleInfo(
        id=str(item["id"]),
        group=str(item["group"]),
        severity=str(item["severity"]),
        checks=str(item["checks"]),
        fix=str(item["fix"]),
        also=tuple(str(s) for s in item.get("also", ())),
        since=str(item["since"]) if item.get("since") is not None else None,
        example=_example(example, bases) if example else None,
        replayed_by=item.get("replayed_by"),
        unreachable=item.get("unreachable"),
        extra={k: v for k, v in item.items() if k not in _KNOWN | {"unreachable"}},
    )


def _example(item: dict[str, Any], bases: dict[str, tuple[str, ...]]) -> Example:
    own = tuple(str(a) for a in item.get("check", ()))
    keys = {_key(a) for a in own}
    base = tuple(a for a in bases[item["base"]] if _key(a) not in keys) if "base" in item else ()
    files = tuple((str(name), str(text)) for name, text in item.get("files", {}).items())
    return Example(
        check=(*base, *own),
        script=item.get("script"),
        args=tuple(str(a) for a in item.get("args", ())),
        files=files,
        crlf=bool(item.get("crlf", False)),
    )


def _key(arg: str) -> str:
    """The key an override argument sets (a base argument the example sets again gives way to it)."""
    return arg.lstrip("+~").partition("=")[0]


__all__ = [
    "DOCS_URL_ENV",
    "SEVERITIES",
    "Example",
    "RuleBook",
    "RuleInfo",
    "docs_url",
    "project_docs_url",
    "rule_book",
]

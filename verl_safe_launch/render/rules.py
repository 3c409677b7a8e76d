"""The rule table as text (``rules``, ``explain RULE``) and as the docs/rules/ pages, all from the same rows."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from verl_safe_launch.data.rulebook import DOCS_URL_ENV, RuleBook, RuleInfo, docs_url
from verl_safe_launch.preflight import Catalogued
from verl_safe_launch.render.table import Column, render_table

SCRIPT = "run.sh"
"""The name an example script is shown (and replayed) under."""


def render_rules_text(catalog: Sequence[Catalogued], *, rich: bool | None = None) -> str:
    """One line per rule: id, severity, since which release, what it checks; then how to read more."""
    columns = [Column("rule"), Column("severity"), Column("since"), Column("checks")]
    rows = [[row.info.id, _severities(row.info), row.since or "all", row.info.checks] for row in catalog]
    tail = f"{len(catalog)} rules; 'verl-safe-launch explain RULE' shows one with its fix and an example\n"
    return render_table(columns, rows, rich=rich) + tail


def render_rule_entry(row: Catalogued) -> str:
    """``explain RULE``: the rule's row in full, with the command that triggers it."""
    info = row.info
    lines = [
        f"{info.id} ({_severities(info)})",
        f"  checks: {info.checks}",
        f"  fix:    {info.fix}",
        f"  since:  {row.since or 'every verl release the tool reads'}",
    ]
    lines += [f"  needs:  {need}" for need in row.needs]
    lines += _example_lines(info, indent="  ")
    lines.append(f"  docs:   {info.url}")
    return "\n".join(lines) + "\n"


def _severities(info: RuleInfo) -> str:
    return "/".join((info.severity, *info.also))


def _example_lines(info: RuleInfo, indent: str) -> list[str]:
    example = info.example
    if example is None:
        reached = info.replayed_by and f"reached in the test suite by {info.replayed_by}"
        return [f"{indent}example: none: {info.unreachable or reached}"]
    lines = [f"{indent}example:"]
    for name, text in example.files:
        lines += [f"{indent}  # {name}", *(f"{indent}  {line}" for line in text.splitlines())]
    if example.script is not None:
        crlf = " (saved with Windows line endings)" if example.crlf else ""
        lines += [
            f"{indent}  # {SCRIPT}{crlf}",
            *(f"{indent}  {line}" for line in example.script.splitlines()),
        ]
    lines.append(f"{indent}  $ {example_command(info)}")
    return lines


def example_command(info: RuleInfo) -> str:
    """The command line of a rule's example, quoted for a shell."""
    assert info.example is not None
    return "verl-safe-launch " + " ".join(shlex.quote(arg) for arg in info.example.argv(SCRIPT))


def rule_pages(catalog: Sequence[Catalogued], book: RuleBook) -> dict[str, str]:
    """docs/rules/: an index, and one page per group with an entry per rule (its anchor is the rule id)."""
    pages = {"index.md": _index(catalog, book)}
    for group, title in book.groups.items():
        rows = [row for row in catalog if row.info.group == group]
        pages[f"{group}.md"] = _group_page(title, rows)
    return pages


def _index(catalog: Sequence[Catalogued], book: RuleBook) -> str:
    lines = [
        "# Rules",
        "",
        "Every rule the tool reports, generated from its rule table (`verl_safe_launch/data/rules.yaml`), as",
        "`verl-safe-launch rules` lists them and `verl-safe-launch explain RULE` shows one. Each entry has an example",
        "that triggers it; the test suite replays every example. Errors block the launch (exit 1); warnings and info",
        "do not ([findings and verdicts](../concepts/findings.md)).",
        "",
        f"These pages are published at <{docs_url()}rules/>: each rule's page there is what SARIF's `helpUri` and",
        "`explain RULE` point to. The address is the package's `Documentation` URL (`[project.urls]` in",
        f"`pyproject.toml`, also mkdocs' `site_url`); `{DOCS_URL_ENV}` overrides it for a copy of the site published",
        "elsewhere.",
        "",
        "| rule | severity | checks |",
        "|---|---|---|",
    ]
    for row in catalog:
        info = row.info
        lines.append(
            f"| [`{info.id}`]({info.group}.md#{info.id}) | {_severities(info)} | {_cell(info.checks)} |"
        )
    lines += ["", "Pages: " + ", ".join(f"[{title}]({group}.md)" for group, title in book.groups.items()), ""]
    return "\n".join(lines)


def _group_page(title: str, rows: Sequence[Catalogued]) -> str:
    lines = [f"# {title}", "", "Generated from the rule table; see [all rules](index.md).", ""]
    for row in rows:
        info = row.info
        lines += [f"## {info.id}", "", f"**{_severities(info)}** · since {row.since or 'every release'}", ""]
        lines += [f"Checks: {info.checks}.", "", f"Fix: {info.fix}.", ""]
        lines += [f"Needs of verl: {need}." for need in row.needs] + ([""] if row.needs else [])
        lines += _example_markdown(info)
    return "\n".join(lines)


def _example_markdown(info: RuleInfo) -> list[str]:
    example = info.example
    if example is None:
        if info.unreachable:
            return [f"No example: {info.unreachable}.", ""]
        return [f"Example: reached by `{info.replayed_by}` (no command alone reaches it).", ""]
    lines = ["Example:", ""]
    for name, text in example.files:
        lines += [f"`{name}`:", "", "```", text.rstrip("\n"), "```", ""]
    if example.script is not None:
        crlf = " (saved with Windows line endings)" if example.crlf else ""
        lines += [f"`{SCRIPT}`{crlf}:", "", "```bash", example.script.rstrip("\n"), "```", ""]
    lines += ["```", example_command(info), "```", ""]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


__all__ = ["SCRIPT", "example_command", "render_rule_entry", "render_rules_text", "rule_pages"]

"""``rules``: every rule the tool reports, from its rule table (id, severity, since which verl, what it checks)."""

from __future__ import annotations

from collections.abc import Sequence

from verl_safe_launch.cli._common import add_format_arg, make_parser, parse, print_json
from verl_safe_launch.preflight import rule_catalog
from verl_safe_launch.render import json_document, render_rules_text

EXAMPLES = """\
  verl-safe-launch rules
  verl-safe-launch rules --format json
  verl-safe-launch explain duplicate-key      # one rule: its fix, an example that triggers it, its page
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``rules``."""
    parser = make_parser("rules", "List every rule the pre-flight and the audit report.", EXAMPLES)
    add_format_arg(parser)
    ns = parse(parser, args)
    catalog = rule_catalog()
    if ns.format == "json":
        print_json(json_document({"rules": [row.to_json() for row in catalog]}))
    else:
        print(render_rules_text(catalog), end="")
    return 0

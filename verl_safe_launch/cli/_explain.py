"""``explain``: the batch arithmetic of a config, step by step, with the formula and keys of each line."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence

from verl_safe_launch.cli._common import (
    add_compose_args,
    add_config_name_args,
    compose_from_args,
    make_parser,
    parse,
    print_json,
)
from verl_safe_launch.errors import UsageError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.render import findings_json, json_document, render_finding

EXAMPLES = """\
  verl-safe-launch explain duplicate-key       # one rule: what it checks, its fix, an example, its page
  verl-safe-launch explain -c launch_examples/grpo_6gpu.yaml
  verl-safe-launch explain data.train_batch_size=48 actor_rollout_ref.rollout.n=12 trainer.n_gpus_per_node=8
  verl-safe-launch explain -c launch_examples/grpo_6gpu.yaml --format json
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``explain``: print the arithmetic, then the batch and layout errors it leads to (exit 0).

    ``explain RULE`` (one word that is no override) prints that rule's entry of the rule table instead.
    """
    if len(args) == 1 and _RULE_WORD.fullmatch(args[0]):
        return _rule(args[0])
    from verl_safe_launch.preflight import rule_context
    from verl_safe_launch.rules import batch_plan, explain, header, render_text, run_rules

    parser = make_parser("explain", "Walk through the batch arithmetic of a config, step by step.", EXAMPLES)
    add_compose_args(parser)
    add_config_name_args(parser)
    ns = parse(parser, args)
    composed = compose_from_args(ns, args, offset)
    view = composed.view
    steps = explain(view)
    errors = [f for f in run_rules(rule_context(composed)) if f.severity is Severity.ERROR]
    if ns.format == "json":
        plan = dataclasses.asdict(batch_plan(view))
        steps_json = [s.to_json() for s in steps]
        fields = {"header": header(view, batch_plan(view)), "plan": plan, "steps": steps_json}
        print_json(json_document(fields | {"errors": findings_json(errors)}))
        return 0
    print(render_text(view, steps), end="")
    print(_problems(errors), end="")
    return 0


_RULE_WORD = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)+")
"""A rule id: lowercase words joined by '-' (never an override: no '=', no '+'/'~')."""


def _rule(rule_id: str) -> int:
    from verl_safe_launch.preflight import catalogued, rule_catalog
    from verl_safe_launch.render import render_rule_entry

    row = catalogued(rule_id)
    if row is None:
        ids = [r.info.id for r in rule_catalog()]
        close = difflib.get_close_matches(rule_id, ids, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UsageError(f"no rule '{rule_id}'", "command line", f"{hint}'verl-safe-launch rules' lists them")
    print(render_rule_entry(row), end="")
    return 0


def _problems(errors: list[Finding]) -> str:
    if not errors:
        return "\nno batch or layout errors\n"
    blocks = [render_finding(f) for f in errors]
    return (
        f"\n{len(errors)} error{'s' if len(errors) != 1 else ''} (run 'verl-safe-launch check' for the full pre-flight):\n\n"
        + "\n\n".join(blocks)
        + "\n"
    )

"""``show``: the resolved config as YAML; ``--origin`` shows where every value came from."""

from __future__ import annotations

from collections.abc import Sequence

from verl_safe_launch.cli._common import (
    add_compose_args,
    add_config_name_args,
    compose_from_args,
    make_parser,
    parse,
    print_json,
    use_verl_of_project,
)
from verl_safe_launch.compose import Composed, resolution_findings
from verl_safe_launch.config_view import ConfigView, format_value
from verl_safe_launch.errors import ConfigError, UsageError, VslError, collect
from verl_safe_launch.provenance import Provenance
from verl_safe_launch.render import escape, escape_lines, json_document

EXAMPLES = """\
  verl-safe-launch show data.train_batch_size=60
  verl-safe-launch show --origin -c launch_examples/grpo_6gpu.yaml
  verl-safe-launch show data.train_batch_size=60 --key data.train_batch_size --origin
  verl-safe-launch show --key actor_rollout_ref.rollout --format json
"""


def main(args: Sequence[str], offset: int) -> int:
    """Run ``show``."""
    parser = make_parser(
        "show", "Print the composed config (resolved), optionally with each value's origin.", EXAMPLES
    )
    parser.add_argument("--origin", action="store_true", help="show where each value came from")
    parser.add_argument("--key", help="one key or subtree (dotted), with its full chain of values")
    add_compose_args(parser)
    add_config_name_args(parser)
    ns = parse(parser, args)
    use_verl_of_project(ns)
    composed = compose_from_args(ns, args, offset)
    view = composed.view
    keys = _selected(view, ns.key)
    _refuse_unresolved(composed, keys)
    if ns.format == "json":
        print_json(_json(view, keys, ns.key, ns.origin))
    elif ns.origin or (ns.key and len(keys) == 1):
        print("\n".join(render_origin(view.provenance[k], chain=bool(ns.key)) for k in keys))
    else:
        print(_yaml(view, ns.key), end="")
    return 0


def _refuse_unresolved(composed: Composed, keys: list[str]) -> None:
    """A value that does not resolve is an error (what verl would hit), not a line of output."""
    wanted = set(keys)
    errors: list[VslError] = [
        ConfigError(f.message, where=f.sources[0][2].describe() if f.sources else None, fix=f.fix)
        for f in resolution_findings(composed)
        if f.keys[0] in wanted
    ]
    if errors:
        raise collect(errors)


def _selected(view: ConfigView, key: str | None) -> list[str]:
    if not key:
        return list(view.keys())
    keys = list(view.subtree(key))
    if not keys:
        import difflib

        close = difflib.get_close_matches(key, list(view.keys()), n=1)
        fix = f"did you mean '{close[0]}'?" if close else "run 'verl-safe-launch show' to list the keys"
        raise UsageError(f"no key '{key}' in the composed config", where="--key", fix=fix)
    return keys


def render_origin(prov: Provenance, *, chain: bool) -> str:
    """One leaf as ``key = value`` with its source; with ``chain`` also every value it replaced."""
    line = f"{escape(prov.key)} = {escape(format_value(prov.value))}"
    lines = [line, f"    from {escape(prov.source.describe())}"]
    if prov.interpolation:
        lines.append(f"    interpolates {escape(prov.interpolation)} (follows {escape(str(prov.follows))})")
    if chain:
        for write in reversed(prov.history):
            lines.append(
                f"    replaced {escape(format_value(write.value))} from {escape(write.source.describe())}"
            )
    return "\n".join(lines)


def _yaml(view: ConfigView, key: str | None) -> str:
    import yaml

    data = view.nested(key or "")
    if key and not isinstance(data, dict):
        data = {key: data}
    return escape_lines(yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True))


def _json(view: ConfigView, keys: list[str], key: str | None, origin: bool) -> object:
    if origin:
        return json_document({"keys": [view.provenance[k].to_json() for k in keys]})
    return json_document({"key": key, "config": view.nested(key or "")})

"""``upgrade``: rewrite a launch script or YAML written for an older verl release for the installed one."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from verl_safe_launch.audit import (
    RELEASES,
    AuditContext,
    Change,
    Upgrade,
    command_line,
    default_changes,
    detect_release,
    hydra_literal,
    installed_defaults,
    plan_migration,
    plan_upgrade,
    render_yaml,
    token_key,
)
from verl_safe_launch.cli._common import add_format_arg, make_parser, parse, print_json
from verl_safe_launch.cli._migrate import choose_launch
from verl_safe_launch.compose import compose
from verl_safe_launch.errors import EXIT_OK
from verl_safe_launch.files import check_target, ensure_directory, write_atomic
from verl_safe_launch.inputs import OverrideToken, read_yaml
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell import ScriptLaunch, read_script

EXAMPLES = """\
  verl-safe-launch upgrade run_qwen_grpo_v05.sh -o upgraded/
  verl-safe-launch upgrade old_run.yaml --from 0.7 -o upgraded/ --force

Writes DIR/NAME.yaml (the launch's values for the installed verl, each citing its original line and the rule that
moved it) and prints the one command that runs it. Moved keys are mapped, global micro batch sizes become per-GPU
sizes (the division is shown), removed keys are dropped and reported with what replaces them, and defaults that
changed since the launch's release are listed with the override that keeps the old behaviour. Nothing ambiguous is
guessed: such overrides are kept as written and reported.
"""

ORDER = ("moved", "converted", "added", "removed", "refused", "unknown", "unresolved", "default")


def main(args: Sequence[str], offset: int) -> int:
    """Run ``upgrade``."""
    parser = make_parser("upgrade", "Rewrite a launch for the installed verl release.", EXAMPLES)
    parser.add_argument(
        "launch_file", metavar="SCRIPT.sh|FILE.yaml", help="a bash launch script or a YAML config"
    )
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="folder for the upgraded YAML")
    parser.add_argument(
        "--from",
        dest="source",
        default="auto",
        choices=("auto", *[s for s in RELEASES if s != "0.9"]),
        help="the verl release the launch was written for (default: detected from its keys)",
    )
    parser.add_argument("--launch", type=int, metavar="N", help="which launch of a script (1-based)")
    parser.add_argument("--force", action="store_true", help="overwrite DIR/NAME.yaml if it exists")
    add_format_arg(parser)
    ns = parse(parser, args)
    path = Path(ns.launch_file)
    launch = _read(path, ns.launch)
    installed = installed_defaults()
    keys = [token_key(t.text)[1] for t in launch.tokens]
    source, detected = (
        (ns.source, f"--from {ns.source}") if ns.source != "auto" else detect_release(keys, installed)
    )
    upgrade = plan_upgrade(launch.tokens, source, detected, installed)
    output = _output(Path(ns.output), path, ns.force)
    upgraded = replace(launch, tokens=upgrade.tokens)
    composed = compose(upgraded.request(lenient=True))
    unknown = [
        Change(
            "unknown",
            r.key,
            f"{r.reason} (not in verl 0.9.1 nor in the release history)",
            r.token.source.line,
        )
        for r in composed.rejected
    ]
    context = AuditContext.build(composed)
    enabled = composed.view.get("reward.reward_model.enable") is True

    def used(key: str) -> bool:
        return context.role_used(key) and (enabled or not key.startswith("reward.reward_model."))

    defaults = default_changes(upgrade.tokens, source, installed, used)
    migration = plan_migration(upgraded, composed, output)
    inputs = [path, *launch.config_files]
    write_atomic(output, render_yaml(migration), force=ns.force, inputs=inputs, where="-o/--output")
    notes = [Change("unresolved", "", note) for note in migration.notes]
    changes = (*upgrade.changes, *unknown, *notes, *defaults)
    if ns.format == "json":
        print_json(_json(path, upgrade, changes, output, command_line(migration)))
    else:
        print(_text(path, upgrade, changes, output, command_line(migration)))
    return EXIT_OK


def _read(path: Path, wanted: int | None) -> ScriptLaunch:
    if path.suffix in (".yaml", ".yml"):
        doc = read_yaml(path, expand_dots=True)
        tokens = tuple(
            OverrideToken(
                f"{leaf.key}={hydra_literal(leaf.value)}",
                Source(Layer.SCRIPT, file=str(path), line=leaf.line, raw=f"{leaf.key}: {leaf.value}"),
            )
            for leaf in doc.leaves
        )
        return ScriptLaunch(str(path), 1, 1, tokens)
    return choose_launch(read_script(path), wanted, str(path))


def _output(folder: Path, source: Path, force: bool) -> Path:
    """DIR/NAME.yaml, DIR created when missing; never the input itself, never an existing file without --force."""
    ensure_directory(folder, where="-o/--output")
    target = folder / f"{source.stem}.yaml"
    check_target(target, force=force, inputs=[source], where="-o/--output")
    return target


def _text(path: Path, upgrade: Upgrade, changes: Sequence[Change], output: Path, command: str) -> str:
    lines = [
        f"upgrade {path}: written for verl {upgrade.source} ({upgrade.detected}); target: the installed verl"
    ]
    for kind in ORDER:
        for change in (c for c in changes if c.kind == kind):
            where = f" (line {change.line})" if change.line is not None else ""
            arrow = f" -> {change.new_key}" if change.new_key and change.new_key != change.key else ""
            head = f"{change.key}{arrow}{where}: " if change.key else ""
            lines.append(f"{kind:<10} {head}{change.detail}")
            if change.fix:
                lines.append(f"           keep the old behaviour: {shlex.quote(change.fix)}")
    lines.append(f"wrote {output}")
    lines.append(command)
    return "\n".join(lines)


def _json(
    path: Path, upgrade: Upgrade, changes: Sequence[Change], output: Path, command: str
) -> dict[str, object]:
    return {
        "schema": 1,
        "input": str(path),
        "source_release": upgrade.source,
        "detected": upgrade.detected,
        "output": str(output),
        "command": command,
        "changes": [
            {
                "kind": c.kind,
                "key": c.key,
                "new_key": c.new_key,
                "line": c.line,
                "detail": c.detail,
                "fix": c.fix,
            }
            for c in changes
        ],
        "summary": {kind: sum(c.kind == kind for c in changes) for kind in ORDER},
    }

"""Plan and render the migration of a launch script: its effective values as a commented, nested user YAML."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.compose import Composed, config_groups
from verl_safe_launch.config_view import nest
from verl_safe_launch.errors import InputError
from verl_safe_launch.inputs import PRIMARY_CONFIG, parse_yaml
from verl_safe_launch.provenance import Layer, Source, Write
from verl_safe_launch.shell import ScriptLaunch, override_key


@dataclass(frozen=True)
class Entry:
    """One key of the YAML: its effective value, the script line that set it, and the lines it replaced."""

    key: str
    value: object
    source: Source
    replaced: tuple[Write, ...] = ()


@dataclass(frozen=True)
class Migration:
    """What goes into the YAML, what stays on the command line, and what could not be migrated."""

    script: str
    line: int
    output: Path
    entries: tuple[Entry, ...]
    config_files: tuple[Path, ...]
    cli_tokens: tuple[str, ...]
    notes: tuple[str, ...]
    command: str | None = None
    check_tokens: tuple[str, ...] = ()
    """What ``check`` adds to reproduce the launch's pre-flight (a job's allocation: its GPU counts)."""


ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"
"""Where a migrated script's exported variables go: the run's environment, which Ray gives every worker."""


def plan_migration(launch: ScriptLaunch, composed: Composed, output: Path) -> Migration:
    """Split a composed launch into YAML entries and command-line tokens, with notes on what was left out."""
    cli = [*_config_name(launch), *(t.text for t in launch.tokens if _stays_on_cli(t.text))]
    deleted = {t.text.lstrip("~").partition("=")[0] for t in launch.tokens if t.text.startswith("~")}
    entries: dict[str, Entry] = {}
    machine = {(n.line, override_key(n.raw)) for n in launch.notes if n.kind == "machine"}
    for write in composed.writes:
        if write.source.layer is not Layer.SCRIPT or write.delete:
            continue
        if any((write.source.line, k) in machine for k in _key_and_parents(write.key)):
            continue
        if any(write.key == d or write.key.startswith(d + ".") for d in deleted):
            cli.append(f"{write.key}={hydra_literal(write.value)}")
            continue
        earlier = entries.get(write.key)
        replaced = (*earlier.replaced, Write(write.key, earlier.value, earlier.source)) if earlier else ()
        entries[write.key] = Entry(write.key, write.value, write.source, replaced)
    for export in launch.exports:
        key = f"{ENV_VARS}.{export.name}"
        if key not in entries and not any(k.startswith(ENV_VARS) for k in deleted):
            raw = f"export {export.name}={export.value}"
            entries[key] = Entry(key, export.value, Source(Layer.SCRIPT, launch.path, export.line, raw=raw))
    kept, moved = _representable(list(entries.values()), launch.path)
    cli += [f"{e.key}={hydra_literal(e.value)}" for e in moved]
    notes = _notes(launch, composed)
    return Migration(launch.path, launch.line, output, tuple(kept), launch.config_files, tuple(cli), notes)


def _config_name(launch: ScriptLaunch) -> list[str]:
    """The launch's verl config, if not ``ppo_trainer``: the group choices of a deprecated alias, else its name."""
    if launch.config_name == PRIMARY_CONFIG:
        return []
    alias = next((n.detail for n in launch.notes if n.kind == "deprecated-config"), None)
    return alias.split() if alias else [f"--config-name={launch.config_name}"]


def _key_and_parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _stays_on_cli(text: str) -> bool:
    key = text.partition("=")[0].lstrip("+~")
    return text.startswith("~") or key in config_groups() or key == "preset" or key.startswith("hardware.")


def _representable(entries: list[Entry], name: str) -> tuple[list[Entry], list[Entry]]:
    """Entries whose YAML reads back to the same value (checked with the YAML reader compose uses)."""
    kept: list[Entry] = []
    moved: list[Entry] = []
    leaves: set[str] = set()
    for entry in entries:
        conflict = any(entry.key.startswith(k + ".") or k.startswith(entry.key + ".") for k in leaves)
        if conflict or not _reads_back(entry):
            moved.append(entry)
        else:
            kept.append(entry)
            leaves.add(entry.key)
    return kept, moved


def _reads_back(entry: Entry) -> bool:
    try:
        doc = parse_yaml(f"x: {yaml_scalar(entry.value)}\n", "value", expand_dots=False)
    except InputError:
        return False
    value = doc.data.get("x")
    same = value == entry.value and type(value) is type(entry.value)
    return same or (isinstance(value, float) and isinstance(entry.value, float) and math.isnan(value))


def _notes(launch: ScriptLaunch, composed: Composed) -> tuple[str, ...]:
    notes = [
        f"left out {r.token.text} (line {r.token.source.line}): {r.reason} Run: verl-safe-launch audit {shlex.quote(launch.path)}"
        for r in composed.rejected
    ]
    for note in launch.notes:
        if note.kind in ("unresolved", "config", "machine"):
            notes.append(
                f"not migrated: {note.raw} (line {note.line}) depends on {note.detail}; add it yourself"
            )
        elif note.kind == "maybe":
            notes.append(
                f"not migrated: {note.raw} (line {note.line}) is passed only on some paths "
                f"({note.detail}); add it yourself"
            )
        elif note.kind == "env-default":
            notes.append(f"line {note.line}: {note.detail}")
    if launch.passthrough is not None:
        line = launch.passthrough.line
        notes.append(
            f'the script passes its own arguments to verl ("$@" on line {line}): append them to the command'
        )
    return tuple(notes)


def yaml_scalar(value: object) -> str:
    """A YAML flow value that reads back as ``value`` (strings always double-quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {yaml_scalar(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def hydra_literal(value: object) -> str:
    """A value as a Hydra override writes it (strings single-quoted)."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, float) and not math.isfinite(value):  # Hydra reads nan and inf, not YAML's .nan
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return "[" + ", ".join(hydra_literal(v) for v in value) + "]"
    return yaml_scalar(value)


def command_line(migration: Migration) -> str:
    """The equivalent ``verl-safe-launch`` command, every argument shell-quoted."""
    if migration.command is not None:
        return migration.command
    words = ["verl-safe-launch"]
    for path in (*migration.config_files, migration.output):
        words += ["-c", str(path)]
    words += migration.cli_tokens
    return " ".join(shlex.quote(w) for w in words)


def check_command(migration: Migration) -> str:
    """The ``verl-safe-launch check`` command that shows the pre-flight of what was migrated."""
    words = ["verl-safe-launch", "check"]
    for path in (*migration.config_files, migration.output):
        words += ["-c", str(path)]
    words += [*migration.cli_tokens, *migration.check_tokens]
    return " ".join(shlex.quote(w) for w in words)


def render_yaml(migration: Migration) -> str:
    """The nested YAML: one line per key with a comment citing the script line it came from."""
    name = _one_line(Path(migration.script).name)
    lines = [
        f"# verl config migrated from {_one_line(migration.script)} (the launch on line {migration.line}).",
        "# Each value cites the script line it came from. Use it with:",
        f"#   {_one_line(command_line(migration))}",
    ]
    tree = nest((entry.key, entry) for entry in migration.entries)
    _emit(tree, 0, name, lines)
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    """Text for a YAML comment: a line break in a file name must not end the comment and start a key."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _emit(tree: dict[str, object], depth: int, name: str, lines: list[str]) -> None:
    pad = "  " * depth
    for key, node in tree.items():
        if isinstance(node, Entry):
            lines.append(f"{pad}{key}: {yaml_scalar(node.value)}  # {_cite(node, name)}")
        else:
            assert isinstance(node, dict)
            lines.append(f"{pad}{key}:")
            _emit(node, depth + 1, name, lines)


def _cite(entry: Entry, name: str) -> str:
    text = f"{name}:{entry.source.line}" if entry.source.line is not None else name
    if entry.source.reason:
        text += f" ({entry.source.reason})"
    if entry.replaced:
        earlier = ", ".join(f"line {w.source.line}: {yaml_scalar(w.value)}" for w in entry.replaced)
        text += f" (replaces {earlier})"
    return text

"""What the two schema readers share: the scalar kinds, the YAML's ``_target_`` classes, a field's type text.

``schema.generate_schema`` (imports verl) and ``schema_ast.SourceReader`` (reads its source) must write the same
schema; both take these from here, so neither imports the other's module just for them.
"""

from __future__ import annotations

from pathlib import Path

SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


def targets_of(config_dir: Path) -> set[str]:
    """Every ``_target_`` class named in the YAML under ``config_dir``."""
    import yaml

    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "_target_" and isinstance(value, str):
                    found.add(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in sorted(config_dir.rglob("*.yaml")):
        walk(yaml.safe_load(path.read_text(encoding="utf-8")))
    return found


def type_text(kinds: set[str], optional: bool, nested: list[str]) -> str:
    """A field's type as the schema writes it (``int | None``, the nested dataclass's name)."""
    names = [n.rpartition(".")[2] for n in nested] if kinds == {"dataclass"} else sorted(kinds)
    return " | ".join([*names, *(["None"] if optional else [])])


__all__ = ["SCALARS", "targets_of", "type_text"]

"""Data flows one way: a module imports only from its own stage, earlier stages, and the shared leaves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "verl_safe_launch"

# Stages in data-flow order (DESIGN.md): a module may import from its stage or any stage before it.
STAGES: list[tuple[str, ...]] = [
    # shared leaves
    (
        "errors",
        "provenance",
        "findings",
        "config_view",
        "verl_paths",
        "architecture",
        "interpolation",
        "shell_words",
        "shell_expand",
        "hook_stages",
        "data",
    ),
    ("_yaml", "overrides", "compose", "overlay", "keytypes", "launch_script"),
    ("aliases", "audit_base", "audit_overrides", "audit_values", "audit", "migrate_yaml"),
    ("rules", "rules_catalog", "rules_kit", "batch", "fixes", "resources", "explain", "rules_*"),
    ("memory", "memory_terms", "memory_engine", "memory_rollout", "memory_checks", "fit"),
    ("hardware", "presets"),
    ("preflight", "report"),
    ("hooks", "launch", "launch.*"),
    ("cli", "cli.*", "__main__", ""),
]


def _stage(module: str) -> int:
    for index, names in enumerate(STAGES):
        for name in names:
            if module == name or (name.endswith("*") and module.startswith(name[:-1])):
                return index
    raise AssertionError(f"verl_safe_launch.{module} is in no stage: add it to STAGES in {__file__}")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_safe_launch"):
            inner = node.module.removeprefix("verl_safe_launch").lstrip(".")
            found.update([a.name for a in node.names] if not inner else [inner])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("verl_safe_launch.") for a in node.names if a.name.startswith("verl_")
            )
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: _module(p) or "__init__")
def test_module_imports_only_earlier_stages(path: Path) -> None:
    module = _module(path)
    mine = _stage(module)
    later = sorted(dep for dep in _imports(path) if _stage(dep) > mine)
    assert later == [], f"verl_safe_launch.{module} (stage {mine}) imports from later stages: {later}"

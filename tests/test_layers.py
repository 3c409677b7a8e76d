"""Data flows one way: a module imports only from its own stage, earlier stages, and the shared leaves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "verl_safe_launch"

# Stages in data-flow order (DESIGN.md): a module may import from its stage or any stage before it.
STAGES: list[tuple[str, ...]] = [
    (
        "errors",
        "environment",
        "files",
        "provenance",
        "findings",
        "config_view",
        "context",
        "data",
        "secret",
    ),  # shared leaves
    ("inputs",),
    ("shell",),
    ("compose",),
    ("audit",),
    ("rules",),
    ("memory",),
    ("presets",),
    ("preflight",),
    ("render",),
    ("launch",),
    ("backends",),
    ("doctor",),
    ("cli", "__main__", ""),
]
LEAVES = STAGES[0]


def _stage(module: str) -> int:
    top = module.split(".")[0]
    for index, names in enumerate(STAGES):
        if top in names:
            return index
    raise AssertionError(f"verl_safe_launch.{module} is in no stage: add it to STAGES in {__file__}")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every verl_safe_launch module a file imports, at module level or inside functions."""
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


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p) or "__init__")
def test_module_imports_only_earlier_stages(path: Path) -> None:
    module = _module(path)
    mine = _stage(module)
    later = sorted(dep for dep in _imports(path) if _stage(dep) > mine)
    assert later == [], f"verl_safe_launch.{module} (stage {mine}) imports from later stages: {later}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p) or "__init__")
def test_other_stages_are_imported_through_their_public_face(path: Path) -> None:
    """Another stage's modules are reached only through its ``__init__`` (its ``__all__``)."""
    module = _module(path)
    mine = module.split(".")[0]
    deep = sorted(
        dep
        for dep in _imports(path)
        if "." in dep and dep.split(".")[0] != mine and dep.split(".")[0] not in LEAVES
    )
    assert deep == [], f"verl_safe_launch.{module} reaches into other stages: {deep}"


def test_no_import_cycle() -> None:
    """The module graph (function-level imports included, packages through their __init__) has no cycle."""
    names = {_module(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        module = _module(path)
        deps: set[str] = set()
        for dep in _imports(path):
            while dep and dep not in names:
                dep = dep.rpartition(".")[0]
            if dep and dep != module and not module.startswith(dep + "."):
                deps.add(dep)
        graph[module] = deps
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_top_level_stays_small() -> None:
    top = [p for p in PACKAGE.glob("*.py")]
    subpackages = [p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name != "data"]
    assert len(top) <= 12, sorted(p.name for p in top)
    assert len(subpackages) >= 5


MAX_MODULE_LINES = 500


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p) or "__init__")
def test_no_module_over_500_lines(path: Path) -> None:
    """A module that outgrows this splits along its seams (STYLE.md, habit 17)."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"verl_safe_launch.{_module(path)} has {lines} lines"


def _verb_modules() -> list[Path]:
    """The verbs' own modules: every ``cli/_*.py`` but the shared argument handling."""
    return sorted(p for p in (PACKAGE / "cli").glob("_*.py") if p.name not in ("__init__.py", "_common.py"))


@pytest.mark.parametrize("path", _verb_modules(), ids=lambda p: p.stem)
def test_a_verb_imports_no_other_verb(path: Path) -> None:
    """What two verbs share lives below them, in a stage (or the argument handling of ``cli/_common.py``)."""
    verbs = {f"cli.{p.stem}" for p in _verb_modules()}
    others = sorted(dep for dep in _imports(path) if dep in verbs and dep != f"cli.{path.stem}")
    assert others == [], f"cli/{path.name} imports other verbs: {others}"


def test_the_verbs_are_found() -> None:
    names = {p.stem for p in _verb_modules()}
    assert {"_run", "_submit", "_slurm", "_kuberay", "_migrate", "_upgrade", "_audit"} <= names


PACKAGES = sorted(p for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", PACKAGES, ids=lambda p: _module(p) or "verl_safe_launch")
def test_each_package_says_in_one_line_what_it_is_for(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{path.relative_to(PACKAGE.parent)} has no docstring"
    assert "\n" not in doc.strip(), f"{path.relative_to(PACKAGE.parent)}: the docstring is more than one line"


def test_every_stage_package_has_a_place() -> None:
    """A new subpackage must be given its place among the stages (STAGES above)."""
    for init in PACKAGE.glob("*/__init__.py"):
        _stage(init.parent.name)

"""The config keys a release's trainer reads before training, whatever the config: read with ``ast`` from its source.

``RayPPOTrainer.__init__``, ``RayPPOTrainer._validate_config`` and ``validate_config`` read ``config.a.b.c`` as
attributes; a key the composed config lacks there stops verl with ``ConfigAttributeError`` before training (a
fork's trainer that reads a key only its own ``ppo_trainer.yaml`` defines, launched with its
``ppo_megatron_trainer``). Only reads that happen on every path are kept: not inside an ``if`` body, a loop, a
``try``, nor the right side of ``and``/``or``; a key the same function writes is not a read of the config as
composed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.inputs.knowledge import cached_fact
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_package_dir

READERS = {
    "trainer/ppo/ray_trainer.py": ("RayPPOTrainer.__init__", "RayPPOTrainer._validate_config"),
    "utils/config.py": ("validate_config",),
}
"""Where each release reads its config before training, by file (under ``verl/``) and function."""
METHODS = frozenset({"get", "items", "keys", "values", "pop", "setdefault", "copy"})
"""Methods of a config node: ``config.a.get("b")`` reads ``a`` only."""
FORMAT = 1


@dataclass(frozen=True)
class ConfigRead:
    """One key read unconditionally: the dotted key, and where (file, line, function)."""

    key: str
    file: str
    line: int
    function: str


@verl_cache
def config_reads() -> tuple[ConfigRead, ...]:
    """Every unconditional read of the verl in use (cached on disk)."""
    raw: list[list[Any]] = cached_fact(f"config-reads-{FORMAT}", lambda: find_reads(verl_package_dir()))
    return tuple(ConfigRead(str(k), str(f), int(n), str(fn)) for k, f, n, fn in raw)


def find_reads(package: Path) -> list[list[Any]]:
    """``[key, file, line, function]`` for each unconditional read in ``package``'s readers."""
    out: list[list[Any]] = []
    for rel, wanted in READERS.items():
        try:
            tree = ast.parse((package / rel).read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError):
            continue
        for name, fn in _functions(tree):
            if name in wanted:
                written = {key for key, _ in _chains(fn, ast.Store)}
                seen: set[str] = set()
                for key, line in _unconditional(fn):
                    if key not in seen and not any(key == w or key.startswith(w + ".") for w in written):
                        seen.add(key)
                        out.append([key, rel, line, name])
    return out


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def _unconditional(fn: ast.FunctionDef) -> Iterator[tuple[str, int]]:
    """Reads in the statements every call runs: the function's own body, and the tests of its ``if``s."""
    for stmt in fn.body:
        if isinstance(stmt, ast.If | ast.While):
            nodes: list[ast.AST] = [stmt.test]
        elif isinstance(stmt, ast.For | ast.AsyncFor):
            nodes = [stmt.iter]
        elif isinstance(
            stmt, ast.Expr | ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Assert | ast.Return
        ):
            nodes = [stmt]
        else:
            nodes = []
        for node in nodes:
            yield from _reads(node)


def _reads(node: ast.AST) -> Iterator[tuple[str, int]]:
    if isinstance(node, ast.BoolOp):
        yield from _reads(node.values[0])  # the others run only on one side of the first
        return
    if isinstance(node, ast.IfExp):
        yield from _reads(node.test)
        return
    if isinstance(node, ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
        return
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in METHODS:
        key = _chain(node.func.value)
        if key is not None:
            yield key, node.lineno
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                yield from _reads(arg)
            return
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        key = _chain(node)
        if key is not None:
            yield key, node.lineno
            return
    for child in ast.iter_child_nodes(node):
        yield from _reads(child)


def _chains(fn: ast.FunctionDef, ctx: type[ast.expr_context]) -> Iterator[tuple[str, int]]:
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ctx):
            key = _chain(node)
            if key is not None:
                yield key, node.lineno


def _chain(node: ast.expr) -> str | None:
    """``config.a.b`` or ``self.config.a.b`` → ``a.b`` (None for anything else)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "config":
        pass
    elif isinstance(node, ast.Name) and node.id == "self" and parts and parts[-1] == "config":
        parts.pop()
    else:
        return None
    return ".".join(reversed(parts)) or None

"""Names in a package read as source files with ``ast``: each module's namespace, its imports followed (``from x
import Y``, star re-exports, ``__all__``) to where a name is defined, without importing anything."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.errors import InputError
from verl_safe_launch.files import read_input

SOURCE_LIMIT = 16 * 1024 * 1024
"""The largest verl source file read (verl's largest is under 200 KiB)."""


class Unknown(Exception):
    """A value or name the static reader cannot work out."""


@dataclass(frozen=True)
class ClassRef:
    module: str
    node: ast.ClassDef


@dataclass(frozen=True)
class ModuleRef:
    name: str


@dataclass(frozen=True)
class External:
    module: str
    name: str


@dataclass(frozen=True)
class ImportRef:
    module: str
    name: str


@dataclass(frozen=True)
class Alias:
    module: str
    expr: ast.expr


Binding = ClassRef | ModuleRef | External | ImportRef | Alias


class PackageNames:
    """The ``verl`` package under ``package`` read as source files: modules and the names they bind."""

    def __init__(self, package: Path) -> None:
        self.package = package
        self.root = package.parent
        self._trees: dict[str, tuple[ast.Module, bool] | None] = {}
        self._spaces: dict[str, dict[str, Binding]] = {}
        self._busy: set[str] = set()

    def _tree(self, module: str) -> tuple[ast.Module, bool] | None:
        """The parsed file of ``module`` and whether it is a package, or None outside this verl."""
        if module not in self._trees:
            found: tuple[ast.Module, bool] | None = None
            if module == "verl" or module.startswith("verl."):
                base = self.root.joinpath(*module.split("."))
                for path, is_package in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
                    if path.is_file():
                        try:
                            data = read_input(path, what="verl source file", limit=SOURCE_LIMIT)
                            found = (ast.parse(data, str(path)), is_package)
                        except (SyntaxError, ValueError, InputError):
                            found = None
                        break
            self._trees[module] = found
        return self._trees[module]

    def _absolute(self, module: str, is_package: bool, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        return ".".join([*parts, *([node.module] if node.module else [])])

    def _statements(self, body: list[ast.stmt]) -> Iterator[ast.stmt]:
        """Top-level statements, including those inside ``if``/``try`` blocks (a guarded import counts)."""
        for stmt in body:
            if isinstance(stmt, ast.If):
                yield from self._statements(stmt.body)
                yield from self._statements(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                yield from self._statements(stmt.body)
                for handler in stmt.handlers:
                    yield from self._statements(handler.body)
                yield from self._statements(stmt.orelse)
                yield from self._statements(stmt.finalbody)
            else:
                yield stmt

    def namespace(self, module: str) -> dict[str, Binding]:
        """The module-level names of ``module`` (empty outside this verl)."""
        if module in self._spaces:
            return self._spaces[module]
        space: dict[str, Binding] = {}
        self._spaces[module] = space  # a cycle of star imports sees the names bound so far
        parsed = self._tree(module)
        if parsed is None:
            return space
        tree, is_package = parsed
        for stmt in self._statements(tree.body):
            if isinstance(stmt, ast.ClassDef):
                space[stmt.name] = ClassRef(module, stmt)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        space[alias.asname] = self._module_binding(alias.name)
                    else:
                        top = alias.name.split(".")[0]
                        space[top] = self._module_binding(top)
            elif isinstance(stmt, ast.ImportFrom):
                source = self._absolute(module, is_package, stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        for name in self._exported(source):
                            space[name] = ImportRef(source, name)
                    else:
                        space[alias.asname or alias.name] = ImportRef(source, alias.name)
            elif (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                space[stmt.targets[0].id] = Alias(module, stmt.value)
            elif (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and stmt.value is not None
            ):
                space[stmt.target.id] = Alias(module, stmt.value)
        return space

    def _module_binding(self, module: str) -> Binding:
        return ModuleRef(module) if self._tree(module) is not None else External(module, "")

    def _exported(self, module: str) -> list[str]:
        """The names ``from module import *`` binds: ``__all__``, else every public name."""
        if self._tree(module) is None:
            return []
        if module in self._busy:
            return []
        self._busy.add(module)
        try:
            space = self.namespace(module)
            declared = space.get("__all__")
            if isinstance(declared, Alias):
                try:
                    names = self._names_list(declared.module, declared.expr)
                    return [n for n in names if isinstance(n, str)]
                except Unknown:
                    pass
            return [name for name in space if not name.startswith("_")]
        finally:
            self._busy.discard(module)

    def _names_list(self, module: str, expr: ast.expr) -> list[Any]:
        if isinstance(expr, ast.List | ast.Tuple):
            return [ast.literal_eval(e) for e in expr.elts]
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return self._names_list(module, expr.left) + self._names_list(module, expr.right)
        if isinstance(expr, ast.Attribute) and expr.attr == "__all__":
            owner = self._resolve_expr(module, expr.value)
            if isinstance(owner, ModuleRef):
                return self._exported(owner.name)
        raise Unknown(ast.unparse(expr))

    def lookup(self, module: str, name: str, depth: int = 0) -> Binding | None:
        """What ``name`` is in ``module``'s namespace (imports followed to where the name is defined)."""
        if depth > 50:
            return None
        if self._tree(module) is None:
            if module in ("builtins", "") or not module:
                return External("builtins", name)
            return External(module, name)
        binding = self.namespace(module).get(name)
        if binding is None:
            sub = f"{module}.{name}"
            if self._tree(sub) is not None:
                return ModuleRef(sub)
            if hasattr(builtins, name):
                return External("builtins", name)
            return None
        if isinstance(binding, ImportRef):
            if self._tree(binding.module) is None:
                return External(binding.module, binding.name)
            found = self.lookup(binding.module, binding.name, depth + 1)
            if found is None and self._tree(f"{binding.module}.{binding.name}") is not None:
                return ModuleRef(f"{binding.module}.{binding.name}")
            return found
        return binding

    def _resolve_expr(self, module: str, expr: ast.expr) -> Binding | None:
        """What a name or dotted attribute in ``module`` refers to."""
        if isinstance(expr, ast.Name):
            return self.lookup(module, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self._resolve_expr(module, expr.value)
            if isinstance(owner, ModuleRef):
                return self.lookup(owner.name, expr.attr)
            if isinstance(owner, External) and owner.name == "":
                return External(owner.module, expr.attr)
            if isinstance(owner, External):
                return External(f"{owner.module}.{owner.name}", expr.attr)
        return None


__all__ = ["Alias", "Binding", "ClassRef", "External", "ImportRef", "ModuleRef", "PackageNames", "Unknown"]

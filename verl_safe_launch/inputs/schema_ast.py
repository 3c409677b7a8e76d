"""verl's config schema read from its source with ``ast``: what ``generate_schema`` says, without importing verl.

The ``_target_`` classes named in the YAML are found in the package's files (through ``from x import Y``, star
re-exports and ``__all__``), their dataclass fields are collected as ``dataclasses.fields`` would (bases in MRO
order, ``ClassVar``/``InitVar`` and unannotated attributes left out) and each annotation is described as
``schema._describe`` describes the evaluated hint. Names from outside verl are looked up in the standard library
only (``typing``, ``collections.abc`` ...); any other outside name is ``any`` unless it is OmegaConf's
``DictConfig``/``ListConfig``.
"""

from __future__ import annotations

import ast
import importlib
import json
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_safe_launch.inputs.knowledge import read_version
from verl_safe_launch.inputs.schema_shape import SCALARS, targets_of, type_text
from verl_safe_launch.inputs.source_names import Alias, Binding, ClassRef, External, PackageNames, Unknown

STDLIB = frozenset(
    {
        "typing",
        "typing_extensions",
        "collections",
        "collections.abc",
        "builtins",
        "enum",
        "pathlib",
        "dataclasses",
    }
)
"""Modules outside verl whose names are looked up for real (importing them is cheap and safe)."""


_MISSING = object()


@dataclass
class _Field:
    name: str
    default: str | None


@dataclass
class _Info:
    """A class as the reader sees it: its MRO and, for a dataclass, its fields."""

    order: list[ClassRef]
    is_dataclass: bool
    fields: dict[str, _Field] = field(default_factory=dict)


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
    ast.Not: operator.not_,
}
_CALLS: dict[str, Callable[..., Any]] = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple}


class SourceReader(PackageNames):
    """The ``verl`` package under ``package`` read as source files: its dataclasses, their fields and types."""

    def __init__(self, package: Path) -> None:
        super().__init__(package)
        self._infos: dict[tuple[str, str], _Info] = {}

    # --- classes -----------------------------------------------------------------------------------------

    def info(self, cls: ClassRef) -> _Info:
        key = (cls.module, cls.node.name)
        if key in self._infos:
            return self._infos[key]
        self._infos[key] = _Info([cls], False)  # a cyclic base reads as a plain class
        bases = [self._resolve_expr(cls.module, b) for b in cls.node.bases]
        base_classes = [b for b in bases if isinstance(b, ClassRef)]
        mro = [cls, *_c3([list(self.info(b).order) for b in base_classes] + [base_classes])]
        decorated = any(self._is_dataclass_decorator(cls.module, d) for d in cls.node.decorator_list)
        inherited = any(self.info(b).is_dataclass for b in base_classes)
        result = _Info(mro, decorated or inherited)
        if decorated:
            result.fields = self._fields(cls, mro)
        elif inherited:
            first = next(b for b in mro[1:] if self.info(b).is_dataclass)
            result.fields = self.info(first).fields
        self._infos[key] = result
        return result

    def _is_dataclass_decorator(self, module: str, node: ast.expr) -> bool:
        target = node.func if isinstance(node, ast.Call) else node
        found = self._resolve_expr(module, target)
        return isinstance(found, External) and (found.module, found.name) == ("dataclasses", "dataclass")

    def _fields(self, cls: ClassRef, mro: list[ClassRef]) -> dict[str, _Field]:
        """``dataclasses.fields`` of a decorated class: the fields of its dataclass bases, then its own."""
        fields: dict[str, _Field] = {}
        for base in reversed(mro[1:]):
            if self.info(base).is_dataclass:
                fields.update(self.info(base).fields)
        for stmt in cls.node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            if self._is_pseudo_field(cls.module, stmt.annotation):
                continue
            name = stmt.target.id
            if stmt.value is not None:
                fields[name] = _Field(name, self._field_default(cls.module, stmt.value))
            else:
                fields[name] = _Field(name, self._inherited_default(mro[1:], name))
        return fields

    def _is_pseudo_field(self, module: str, annotation: ast.expr) -> bool:
        """A ``ClassVar`` or ``InitVar`` annotation (as a name, a subscript or a string): not a field."""
        node = annotation
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return False
        if isinstance(node, ast.Subscript):
            node = node.value
        found = self._resolve_expr(module, node)
        return isinstance(found, External) and found.name in ("ClassVar", "InitVar")

    def _inherited_default(self, bases: list[ClassRef], name: str) -> str | None:
        """The class attribute a redeclared field without ``=`` inherits (``getattr(cls, name)``)."""
        for base in bases:
            for stmt in base.node.body:
                value = _assigned(stmt, name)
                if value is None:
                    continue
                if self.info(base).is_dataclass and self._field_call(base.module, value) is not None:
                    default = self._field_default(base.module, value)
                    if default in (None, "(factory)"):
                        continue  # dataclass removes the class attribute of such a field
                    return default
                return self._field_default(base.module, value)
        return None

    def _field_call(self, module: str, value: ast.expr) -> ast.Call | None:
        if isinstance(value, ast.Call):
            found = self._resolve_expr(module, value.func)
            if isinstance(found, External) and (found.module, found.name) == ("dataclasses", "field"):
                return value
        return None

    def _field_default(self, module: str, value: ast.expr) -> str | None:
        call = self._field_call(module, value)
        if call is None:
            return _default_text(self._value(module, value))
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        if "default" in keywords:
            return _default_text(self._value(module, keywords["default"]))
        if "default_factory" in keywords:
            return "(factory)"
        return None

    def _value(self, module: str, node: ast.expr, depth: int = 0) -> Any:
        """The value of a default expression, or ``Unknown`` for one the reader cannot evaluate."""
        if depth > 20:
            return _Opaque(node)
        try:
            return self._evaluate(module, node, depth)
        except (Unknown, ArithmeticError, TypeError, ValueError):
            return _Opaque(node)

    def _evaluate(self, module: str, node: ast.expr, depth: int) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._evaluate(module, node.operand, depth))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left = self._evaluate(module, node.left, depth)
            right = self._evaluate(module, node.right, depth)
            if isinstance(node.op, ast.Pow) and isinstance(right, int) and right > 256:
                raise Unknown("large power")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.Tuple):
            return tuple(self._evaluate(module, e, depth) for e in node.elts)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
            if node.keywords or isinstance(self.lookup(module, node.func.id), ClassRef | Alias):
                raise Unknown(node.func.id)
            return _CALLS[node.func.id](*(self._evaluate(module, a, depth) for a in node.args))
        if isinstance(node, ast.Name | ast.Attribute):
            found = self._resolve_expr(module, node)
            if isinstance(found, Alias):
                value = self._value(found.module, found.expr, depth + 1)
                if isinstance(value, _Opaque):
                    raise Unknown(ast.unparse(node))
                return value
            if isinstance(found, External):
                return _outside_value(found)
        raise Unknown(ast.unparse(node))

    # --- annotations -------------------------------------------------------------------------------------

    def hint(self, info: _Info, name: str) -> tuple[str, ast.expr] | None:
        """The annotation ``typing.get_type_hints`` keeps for ``name``: the most derived class's, and its module."""
        for cls in info.order:
            for stmt in cls.node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == name
                ):
                    return cls.module, stmt.annotation
        return None

    def describe(self, module: str, node: ast.expr, depth: int = 0) -> tuple[set[str], bool, list[str]]:
        """What ``schema._describe`` says of the evaluated annotation ``node``."""
        if depth > 30:
            return {"any"}, False, []
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                try:
                    return self.describe(module, ast.parse(node.value.strip(), mode="eval").body, depth + 1)
                except SyntaxError:
                    return {"any"}, False, []
            return {"any"}, False, []  # a bare None is NoneType: no kind of its own
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._union(module, [node.left, node.right], depth)
        if isinstance(node, ast.Subscript):
            head = self._resolve_expr(module, node.value)
            args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
            if isinstance(head, External) and head.module in ("typing", "typing_extensions"):
                if head.name == "Optional":
                    return self._union(module, [*args, ast.Constant(None)], depth)
                if head.name == "Union":
                    return self._union(module, args, depth)
                if head.name == "Literal":
                    return self._literal(module, args)
                if head.name == "Annotated":
                    return self.describe(module, args[0], depth + 1)
            return self._base(module, head, depth)
        return self._base(module, self._resolve_expr(module, node), depth)

    def _union(self, module: str, args: list[ast.expr], depth: int) -> tuple[set[str], bool, list[str]]:
        kinds: set[str] = set()
        optional = False
        nested: list[str] = []
        for arg in self._flatten(args):
            if _is_none(arg):
                optional = True
                continue
            more, opt, inner = self.describe(module, arg, depth + 1)
            kinds |= more
            optional = optional or opt
            nested += [n for n in inner if n not in nested]
        return kinds, optional, nested

    def _flatten(self, args: list[ast.expr]) -> list[ast.expr]:
        out: list[ast.expr] = []
        for arg in args:
            if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.BitOr):
                out += self._flatten([arg.left, arg.right])
            else:
                out.append(arg)
        return out

    def _literal(self, module: str, args: list[ast.expr]) -> tuple[set[str], bool, list[str]]:
        values: list[Any] = []
        for arg in args:
            value = self._value(module, arg)
            values.append(value)
        kinds = {"any" if isinstance(v, _Opaque) else SCALARS.get(type(v), "any") for v in values}
        return kinds, any(v is None for v in values), []

    def _base(self, module: str, found: Binding | None, depth: int) -> tuple[set[str], bool, list[str]]:
        if isinstance(found, Alias):
            return self.describe(found.module, found.expr, depth + 1)
        if isinstance(found, ClassRef):
            info = self.info(found)
            if info.is_dataclass:
                return {"dataclass"}, False, [f"{found.module}.{found.node.name}"]
            for cls in info.order:
                for base in cls.node.bases:
                    outer = self._resolve_expr(cls.module, base)
                    if isinstance(outer, External):
                        kind = _outside_kind(outer, as_base=True)
                        if kind != "any":
                            return {kind}, False, []
            return {"any"}, False, []
        if isinstance(found, External):
            return {_outside_kind(found)}, False, []
        return {"any"}, False, []

    # --- the schema --------------------------------------------------------------------------------------

    def target(self, target: str) -> ClassRef | None:
        """The class a ``_target_`` names (``getattr(import_module(module), name)``), if defined in this verl."""
        module, _, name = target.rpartition(".")
        if self._tree(module) is None:
            return None
        found = self.lookup(module, name)
        return found if isinstance(found, ClassRef) else None

    def files(self) -> list[str]:
        """The files read so far, relative to the directory above the package (``verl/.../actor.py``)."""
        out = []
        for module, parsed in self._trees.items():
            if parsed is not None:
                base = Path(*module.split("."))
                out.append((base / "__init__.py" if parsed[1] else base.with_suffix(".py")).as_posix())
        return sorted(out)

    def schema(self, config_dir: Path) -> dict[str, Any]:
        queue = sorted(targets_of(config_dir))
        classes: dict[str, Any] = {}
        while queue:
            target = queue.pop(0)
            if target in classes:
                continue
            cls = self.target(target)
            if cls is None:
                continue
            info = self.info(cls)
            if not info.is_dataclass:
                continue
            fields: dict[str, Any] = {}
            for f in info.fields.values():
                if f.name.startswith("_"):
                    continue
                hint = self.hint(info, f.name)
                kinds, optional, nested = self.describe(*hint) if hint else ({"any"}, False, [])
                queue.extend(nested)
                fields[f.name] = {
                    "kinds": sorted(kinds),
                    "optional": optional,
                    "type": type_text(kinds, optional, nested),
                    "default": f.default,
                    "dataclass": nested[0] if kinds == {"dataclass"} and len(nested) == 1 else None,
                }
            classes[target] = fields
        return {"verl_version": read_version(self.package), "classes": dict(sorted(classes.items()))}


@dataclass(frozen=True)
class _Opaque:
    """A default the reader cannot evaluate: shown as its source text."""

    node: ast.expr


def _assigned(stmt: ast.stmt, name: str) -> ast.expr | None:
    """The value a class-body statement assigns to ``name``, if it does."""
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
        return stmt.value
    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
        return stmt.value
    return None


def _default_text(value: Any) -> str:
    if isinstance(value, _Opaque):
        return ast.unparse(value.node)
    return json.dumps(value) if isinstance(value, str) else repr(value)


OUTSIDE_VALUES = {("omegaconf", "MISSING"): "???", ("omegaconf.omegaconf", "MISSING"): "???"}
"""Constants from outside verl that defaults name (OmegaConf's mandatory-value marker)."""
VALUE_MODULES = frozenset({"builtins", "math", "sys", "os", "typing"})


def _outside_value(found: External) -> Any:
    """A constant from outside verl: a known one, or a plain number or string of a standard module."""
    if (found.module, found.name) in OUTSIDE_VALUES:
        return OUTSIDE_VALUES[(found.module, found.name)]
    if found.module in VALUE_MODULES and found.name:
        try:
            value = getattr(importlib.import_module(found.module), found.name)
        except (ImportError, AttributeError) as exc:
            raise Unknown(found.name) from exc
        if value is None or type(value) in (int, float, str, bool):
            return value
    raise Unknown(found.name)


def _is_none(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and node.value is None) or (
        isinstance(node, ast.Constant) and node.value == "None"
    )


def _outside_kind(found: External, as_base: bool = False) -> str:
    """The kind ``_describe`` gives a name from outside verl (the standard library's looked up for real)."""
    from collections.abc import Mapping, Sequence

    if found.name in ("DictConfig", "ListConfig"):
        return "dict" if found.name == "DictConfig" else "list"
    if found.module not in STDLIB or not found.name:
        return "any"
    try:
        obj = getattr(importlib.import_module(found.module), found.name)
    except (ImportError, AttributeError):
        return "any"
    base = typing.get_origin(obj) or obj
    if base in SCALARS and not as_base:
        return SCALARS[base]
    if isinstance(base, type) and issubclass(base, Mapping):
        return "dict"
    if isinstance(base, type) and issubclass(base, Sequence | set) and base is not str:
        return "list"
    return "any"


def _c3(sequences: list[list[ClassRef]]) -> list[ClassRef]:
    """C3 linearisation of the bases' MROs (a class that cannot be linearised keeps a depth-first order)."""
    seqs = [list(s) for s in sequences if s]
    out: list[ClassRef] = []
    while seqs:
        for seq in seqs:
            head = seq[0]
            if not any(head in s[1:] for s in seqs):
                break
        else:
            for seq in seqs:
                out += [c for c in seq if c not in out]
            return out
        out.append(head)
        seqs = [[c for c in s if c != head] for s in seqs]
        seqs = [s for s in seqs if s]
    return out


def read_schema(package: Path) -> dict[str, Any]:
    """The schema of the verl package at ``package`` (its ``verl/`` directory), read without importing it."""
    return SourceReader(package).schema(package / "trainer" / "config")


__all__ = ["SourceReader", "read_schema"]

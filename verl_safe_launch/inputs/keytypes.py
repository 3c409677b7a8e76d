"""What verl's config schema says about each key: its default, expected type, and dataclass-only fields."""

from __future__ import annotations

import ast
import bisect
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.inputs.verl_paths import verl_package_dir
from verl_safe_launch.provenance import Layer, Write

TARGET = "_target_"
_SCALAR_KINDS = {"int": "int", "float": "float", "bool": "bool", "str": "str"}
_SEQUENCE = re.compile(r"^(list|List|tuple|Tuple|Sequence)\b")
_OPTIONAL = re.compile(r"^Optional\[(.*)\]$")


@dataclass(frozen=True)
class TypeSpec:
    """The expected kind of a value (int, float, bool, str or list) and whether null is allowed."""

    kind: str
    optional: bool
    origin: str


@dataclass(frozen=True)
class FieldInfo:
    """One dataclass field: its class, annotation, and the default written in the class (source text)."""

    owner: str
    name: str
    annotation: str
    default: str | None


@dataclass(frozen=True)
class KeyFacts:
    """verl's defaults for one composition, the expected types, and the dataclass-only fields."""

    defaults: dict[str, object]
    types: dict[str, TypeSpec]
    dc_only: dict[str, FieldInfo]
    mandatory: tuple[str, ...] = ()

    def known(self, key: str) -> bool:
        """True when verl's YAML or a config dataclass declares ``key``."""
        return key in self.defaults or key in self.dc_only

    def free_form_parent(self, key: str) -> str | None:
        """The nearest parent whose default is an empty mapping or null (free-form, any key may go below)."""
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:cut])
            if parent in self.defaults:
                value = self.defaults[parent]
                return parent if value is None or value == {} else None
        return None


def verl_defaults(writes: Sequence[Write]) -> dict[str, object]:
    """The last value verl's own YAML wrote for each key (before any user layer)."""
    return {w.key: w.value for w in writes if w.source.layer is Layer.VERL}


_FACTS: dict[tuple[str | None, ...], KeyFacts] = {}


_SEEN: dict[tuple[int, int], tuple[Write, Write, tuple[str | None, ...]]] = {}


def verl_prefix(writes: Sequence[Write]) -> int:
    """How many writes come from verl's defaults (composition records them first)."""
    return bisect.bisect_left(writes, True, key=lambda w: w.source.layer is not Layer.VERL)


def verl_files(writes: Sequence[Write]) -> tuple[str | None, ...]:
    """The verl YAML files a composition read, in order: they alone determine verl's defaults.

    Compositions that share their verl writes (the fast overlay) are recognised by identity, without a scan.
    """
    count = verl_prefix(writes)
    if not count:
        return ()
    first, last = writes[0], writes[count - 1]
    seen = _SEEN.get((id(first), count))
    if seen is not None and seen[0] is first and seen[1] is last:
        return seen[2]
    files = tuple(dict.fromkeys(w.source.file for w in writes[:count]))
    _SEEN[(id(first), count)] = (first, last, files)
    return files


def key_facts(writes: Sequence[Write]) -> KeyFacts:
    """Facts for the composition these writes came from (cached by the verl files composed)."""
    files = verl_files(writes)
    if files not in _FACTS:
        _FACTS[files] = _facts(verl_defaults(writes))
    return _FACTS[files]


def _facts(defaults: dict[str, object]) -> KeyFacts:
    types: dict[str, TypeSpec] = {}
    dc_only: dict[str, FieldInfo] = {}
    prefixes = {k[:i] for k in defaults for i, ch in enumerate(k) if ch == "."}
    for key, target in defaults.items():
        if not key.endswith(TARGET) or not isinstance(target, str):
            continue
        section = key[: -len(TARGET) - 1] if key != TARGET else ""
        for info in dataclass_fields(target).values():
            full = f"{section}.{info.name}" if section else info.name
            spec = annotation_type(info.annotation, f"{info.owner}.{info.name}: {info.annotation}")
            if full in defaults:
                if spec and _consistent(spec, defaults[full]):
                    types[full] = spec
            elif full not in prefixes:
                dc_only[full] = info
    for key, value in defaults.items():
        if key not in types and (spec := _value_type(value)):
            types[key] = spec
    mandatory = tuple(k for k, v in defaults.items() if v == "???")
    return KeyFacts(defaults, types, dc_only, mandatory)


def _consistent(spec: TypeSpec, default: object) -> bool:
    """Trust an annotation only where verl's own YAML default agrees with it."""
    if default is None or (isinstance(default, str) and ("${" in default or default == "???")):
        return True
    found = _value_type(default)
    return found is not None and (found.kind == spec.kind or (spec.kind == "float" and found.kind == "int"))


def _value_type(value: object) -> TypeSpec | None:
    origin = "verl's default"
    if isinstance(value, bool):
        return TypeSpec("bool", False, origin)
    if isinstance(value, int):
        return TypeSpec("int", False, origin)
    if isinstance(value, float):
        return TypeSpec("float", False, origin)
    if isinstance(value, list):
        return TypeSpec("list", False, origin)
    return None


def annotation_type(annotation: str, origin: str) -> TypeSpec | None:
    """Map a dataclass annotation (``Optional[int]``, ``int | None``, ``list[str]``) to a TypeSpec."""
    text = annotation.replace(" ", "")
    optional = False
    if match := _OPTIONAL.match(text):
        text, optional = match.group(1), True
    parts = [p for p in text.split("|") if p != "None"]
    optional = optional or len(parts) < len(text.split("|"))
    if len(parts) != 1:
        return None
    text = parts[0]
    if text in _SCALAR_KINDS:
        return TypeSpec(_SCALAR_KINDS[text], optional, origin)
    if _SEQUENCE.match(text):
        return TypeSpec("list", optional, origin)
    return None


def dataclass_fields(target: str) -> dict[str, FieldInfo]:
    """Fields of a verl config dataclass named by its ``_target_``, inherited ones included (read, not imported)."""
    module, _, name = target.rpartition(".")
    return dict(_fields_of(module, name, 0))


def _fields_of(module: str, name: str, depth: int) -> list[tuple[str, FieldInfo]]:
    found = _find_class(module, name)
    if found is None or depth > 8:
        return []
    node, home = found
    out: list[tuple[str, FieldInfo]] = []
    for base in node.bases:
        base_name = ast.unparse(base).rsplit(".", 1)[-1]
        out.extend(_fields_of(home, base_name, depth + 1))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            field_name = stmt.target.id
            annotation = ast.unparse(stmt.annotation)
            if field_name.startswith("_") or "ClassVar" in annotation:
                continue
            default = ast.unparse(stmt.value) if stmt.value is not None else None
            out.append((field_name, FieldInfo(name, field_name, annotation, default)))
    return out


def _find_class(module: str, name: str) -> tuple[ast.ClassDef, str] | None:
    for candidate in (module, "verl.workers.config", "verl.trainer.config", "verl.utils.profiler", "verl"):
        for path in _module_files(candidate):
            classes = _classes(path)
            if name in classes:
                return classes[name], candidate
    return None


@functools.cache
def _module_files(module: str) -> tuple[Path, ...]:
    root = verl_package_dir().parent
    path = root.joinpath(*module.split("."))
    if path.is_dir():
        return tuple(sorted(path.glob("*.py")))
    file = path.with_suffix(".py")
    return (file,) if file.is_file() else ()


@functools.cache
def _classes(path: Path) -> dict[str, ast.ClassDef]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def names_read_with_get() -> frozenset[str]:
    """Key names verl's code reads with ``.get("name")`` (keys it reads without declaring them)."""
    pattern = re.compile(r"\.get\(\s*[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']")
    names: set[str] = set()
    for path in verl_package_dir().rglob("*.py"):
        try:
            names.update(pattern.findall(path.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return frozenset(names)

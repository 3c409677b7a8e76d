"""What verl's config schema says about each key: its default, expected type, and dataclass-only fields."""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

from verl_safe_launch.inputs.schema import SchemaField, load_schema
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_config_dir, verl_package_dir
from verl_safe_launch.provenance import Layer, Write

TARGET = "_target_"
_KINDS = frozenset({"int", "float", "bool", "str", "list"})


PASSED_THROUGH = ("ray_kwargs.ray_init",)
"""Nodes verl hands on whole: ``ray.init(**ray_kwargs.ray_init)`` takes any of Ray's keyword arguments, so a key
such as ``ray_kwargs.ray_init.runtime_env.env_vars.NAME`` is read (by Ray) although verl's YAML does not list it."""


@dataclass(frozen=True)
class TypeSpec:
    """The expected kind of a value (int, float, bool, str or list) and whether null is allowed."""

    kind: str
    optional: bool
    origin: str


FieldInfo = SchemaField
"""One dataclass field (kept under its older name)."""


@dataclass(frozen=True)
class KeyFacts:
    """verl's defaults for one composition, the expected types, and the dataclass-only fields."""

    defaults: dict[str, object]
    types: dict[str, TypeSpec]
    dc_only: dict[str, FieldInfo]
    mandatory: tuple[str, ...] = ()
    open_nodes: frozenset[str] = frozenset()
    backed: dict[str, str] | None = None

    def known(self, key: str) -> bool:
        """True when verl's YAML or a config dataclass declares ``key``."""
        return key in self.defaults or key in self.dc_only

    def free_form_parent(self, key: str) -> str | None:
        """The nearest parent that is free-form (an empty mapping, null, or a dict-typed dataclass field)."""
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:cut])
            if parent in self.open_nodes:
                return parent
            if parent in self.defaults:
                value = self.defaults[parent]
                return parent if value is None or value == {} else None
        return None

    def backing_class(self, node: str) -> str | None:
        """The config dataclass (its ``_target_``) that verl builds from ``node``, if any."""
        return (self.backed or {}).get(node)


def verl_defaults(writes: Sequence[Write]) -> dict[str, object]:
    """The last value verl's own YAML wrote for each key (before any user layer)."""
    return {w.key: w.value for w in writes if w.source.layer is Layer.VERL}


_FACTS: dict[tuple[str | None, ...], KeyFacts] = {}


_SEEN: dict[tuple[int, int], tuple[Write, Write, tuple[str | None, ...]]] = {}


def verl_prefix(writes: Sequence[Write]) -> int:
    """How many writes come from verl's defaults (composition records them first)."""
    return bisect.bisect_left(writes, True, key=lambda w: w.source.layer is not Layer.VERL)


def verl_files(writes: Sequence[Write]) -> tuple[str | None, ...]:
    """The verl package in use and the YAML files a composition read from it, in order: they alone determine
    verl's defaults. The files are shown relative to the package (``verl/trainer/config/...``), alike in every copy,
    so the package comes first: two copies never share a key.

    Compositions that share their verl writes (the fast overlay) are recognised by identity, without a scan.
    """
    count = verl_prefix(writes)
    if not count:
        return ()
    first, last = writes[0], writes[count - 1]
    seen = _SEEN.get((id(first), count))
    if seen is not None and seen[0] is first and seen[1] is last:
        return seen[2]
    files = (str(verl_package_dir()), *dict.fromkeys(w.source.file for w in writes[:count]))
    _SEEN[(id(first), count)] = (first, last, files)
    return files


def key_facts(writes: Sequence[Write]) -> KeyFacts:
    """Facts for the composition these writes came from (cached by the verl files composed)."""
    files = verl_files(writes)
    if files not in _FACTS:
        _FACTS[files] = _facts(verl_defaults(writes))
    return _FACTS[files]


def _facts(defaults: dict[str, object]) -> KeyFacts:
    facts = _Collect(defaults)
    for key, target in defaults.items():
        if key.endswith(TARGET) and isinstance(target, str):
            facts.section(key[: -len(TARGET) - 1] if key != TARGET else "", target, 0)
    types = facts.types
    numbers = float_leaves() | {key.rpartition(".")[2] for key, v in defaults.items() if isinstance(v, float)}
    for key, value in defaults.items():
        if key not in types and key not in facts.unchecked and (spec := _value_type(value)):
            if spec.kind == "int" and key.rpartition(".")[2] in numbers:
                spec = TypeSpec("float", False, spec.origin)  # verl writes the same leaf as a float elsewhere
            types[key] = spec
    mandatory = tuple(k for k, v in defaults.items() if v == "???")
    open_nodes = frozenset({*facts.open_nodes, *PASSED_THROUGH})
    return KeyFacts(defaults, types, facts.dc_only, mandatory, open_nodes, facts.backed)


class _Collect:
    """Walks verl's defaults and the schema together: each dataclass-backed node, and the dataclasses inside it."""

    def __init__(self, defaults: dict[str, object]) -> None:
        self.defaults = defaults
        self.prefixes = {k[:i] for k in defaults for i, ch in enumerate(k) if ch == "."}
        self.types: dict[str, TypeSpec] = {}
        self.dc_only: dict[str, FieldInfo] = {}
        self.open_nodes: set[str] = set()
        self.unchecked: set[str] = set()
        self.backed: dict[str, str] = {}

    def section(self, section: str, target: str, depth: int) -> None:
        fields = dataclass_fields(target)
        if not fields or section in self.backed or depth > 6:
            return
        self.backed[section] = target
        for info in fields.values():
            full = f"{section}.{info.name}" if section else info.name
            if info.open:
                self.open_nodes.add(full)
            spec = field_type(info)
            if spec is None:
                self.unchecked.add(full)
            if info.nested is not None and full in self.prefixes:
                self.section(full, info.nested, depth + 1)
            elif full in self.defaults:
                if spec and _consistent(spec, self.defaults[full]):
                    self.types[full] = spec
            elif full not in self.prefixes:
                self.dc_only[full] = info


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


def field_type(field: SchemaField) -> TypeSpec | None:
    """The TypeSpec of a dataclass field with one kind (unions such as ``str | float`` are not checked)."""
    if len(field.kinds) != 1 or field.kinds[0] not in _KINDS:
        return None
    return TypeSpec(field.kinds[0], field.optional, f"{field.owner}.{field.name}: {field.text}")


def dataclass_field_names(target: str) -> tuple[str, ...]:
    """The field names of a verl config dataclass (its ``_target_``)."""
    return tuple(load_schema().get(target, {}))


def dataclass_fields(target: str) -> dict[str, SchemaField]:
    """Fields of a verl config dataclass named by its ``_target_``, inherited ones included (from the schema)."""
    return dict(load_schema().get(target, {}))


@verl_cache
def float_leaves() -> frozenset[str]:
    """Leaf names verl's own YAML files give a float somewhere (``top_p: 1.0``): a number, never only an int."""
    from verl_safe_launch.errors import InputError
    from verl_safe_launch.inputs.yamlfile import read_yaml

    names: set[str] = set()
    for path in sorted(verl_config_dir().rglob("*.yaml")):
        try:
            leaves = read_yaml(path, expand_dots=False).leaves
        except InputError:  # a file verl's Hydra would refuse is no evidence either way
            continue
        names.update(leaf.key.rpartition(".")[2] for leaf in leaves if isinstance(leaf.value, float))
    return frozenset(names)


@verl_cache
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

"""verl's config schema from its own dataclasses: field types (unions, open dicts, nested dataclasses) per class.

Generated once from the installed verl (``dataclasses.fields`` + ``typing.get_type_hints``) into
``verl_safe_launch/data/verl_schema.json``; reading it needs neither verl nor torch. Any other verl (``--verl``,
a vendored copy, another release) has its schema read from its source by ``schema_ast``, which imports nothing.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from verl_safe_launch.errors import InputError
from verl_safe_launch.files import read_input
from verl_safe_launch.inputs.schema_shape import SCALARS, targets_of, type_text
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_package_dir

SCHEMA_FILE = "verl_schema.json"


@dataclass(frozen=True)
class SchemaField:
    """One field of a verl config dataclass: its kinds (``int``, ``dict``, ``dataclass`` ...), nullability, default."""

    owner: str
    name: str
    kinds: tuple[str, ...]
    optional: bool
    text: str
    default: str | None
    nested: str | None = None

    @property
    def open(self) -> bool:
        """True for a dict-typed (or untyped) field: any key may go below it."""
        return "dict" in self.kinds or "any" in self.kinds


@verl_cache
def load_schema() -> Mapping[str, Mapping[str, SchemaField]]:
    """``_target_`` → field name → field, for the verl in use.

    The shipped data file when the verl in use is the one it was generated from (same release, same bytes in
    the config YAML and in the files its classes were read from); else read from that verl's source (``ast``,
    never imported) and cached on disk per verl.
    """
    data = shipped_schema()
    package = verl_package_dir()
    if not is_shipped_verl(package, data):
        from verl_safe_launch.inputs.knowledge import cached_fact
        from verl_safe_launch.inputs.schema_ast import read_schema

        data = cached_fact("schema", lambda: read_schema(package))
    out: dict[str, dict[str, SchemaField]] = {}
    for target, fields in data["classes"].items():
        owner = target.rpartition(".")[2]
        out[target] = {
            name: SchemaField(
                owner, name, tuple(f["kinds"]), f["optional"], f["type"], f["default"], f.get("dataclass")
            )
            for name, f in fields.items()
        }
    return out


def shipped_schema() -> dict[str, Any]:
    """The data file shipped with this tool (generated from one verl release)."""
    text = resources.files("verl_safe_launch.data").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)  # type: ignore[no-any-return]


def is_shipped_verl(package: Path, data: Mapping[str, Any]) -> bool:
    """Whether ``package`` is the verl the shipped schema ``data`` was generated from (release and bytes)."""
    from verl_safe_launch.inputs.knowledge import read_version

    source = data.get("source") or {}
    if read_version(package) != data.get("verl_version") or "digest" not in source:
        return False
    return bool(source_digest(package, source.get("files", [])) == source["digest"])


SOURCE_LIMIT = 16 * 1024 * 1024
"""The largest verl source file read (verl's largest is under 200 KiB)."""


def source_digest(package: Path, files: Sequence[str]) -> str:
    """A hash of the config YAML of ``package`` and of ``files`` (paths relative to the directory above it)."""
    import hashlib

    digest = hashlib.sha256()
    config = package / "trainer" / "config"
    paths = [*sorted(config.rglob("*.yaml")), *(package.parent / f for f in files)]
    for path in paths:
        digest.update(path.relative_to(package.parent).as_posix().encode() + b"\0")
        try:
            digest.update(read_input(path, what="verl source file", limit=SOURCE_LIMIT))
        except InputError:  # missing, not a regular file, or too large: never read, never waited on
            digest.update(b"(unreadable)")
        digest.update(b"\0")
    return digest.hexdigest()


def ship_schema(package: Path) -> dict[str, Any]:
    """The data file's content for the verl at ``package`` (imports it): its schema and what it was read from.

    Regenerate with ``python -c "import json; from verl_safe_launch.inputs import verl_package_dir;
    from verl_safe_launch.inputs.schema import ship_schema; print(json.dumps(ship_schema(verl_package_dir()),
    indent=1, sort_keys=True))" > verl_safe_launch/data/verl_schema.json``.
    """
    from verl_safe_launch.inputs.schema_ast import SourceReader

    data = generate_schema(package / "trainer" / "config")
    reader = SourceReader(package)
    reader.schema(package / "trainer" / "config")
    files = reader.files()
    data["source"] = {"files": files, "digest": source_digest(package, files)}
    return data


def generate_schema(config_dir: Path) -> dict[str, Any]:
    """The schema of every config dataclass named by a ``_target_`` in verl's YAML (imports verl)."""
    import dataclasses
    import importlib

    import verl

    queue = sorted(targets_of(config_dir))
    classes: dict[str, Any] = {}
    while queue:
        target = queue.pop(0)
        if target in classes:
            continue
        module, _, name = target.rpartition(".")
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module == exc.name or module.startswith(f"{exc.name}.")):
                continue  # a stale ``_target_`` naming a module this verl does not have: no class
            raise
        cls = getattr(imported, name, None)
        if cls is None or not dataclasses.is_dataclass(cls):
            continue
        hints = typing.get_type_hints(cls)
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            kinds, optional, nested = _describe(hints.get(f.name, Any))
            queue.extend(nested)
            fields[f.name] = {
                "kinds": sorted(kinds),
                "optional": optional,
                "type": type_text(kinds, optional, nested),
                "default": _default(f),
                "dataclass": nested[0] if kinds == {"dataclass"} and len(nested) == 1 else None,
            }
        classes[target] = fields
    return {"verl_version": verl.__version__, "classes": dict(sorted(classes.items()))}


def _describe(hint: Any) -> tuple[set[str], bool, list[str]]:
    """The kinds a type hint allows, whether it allows None, and the dataclasses it names."""
    import dataclasses

    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        kinds: set[str] = set()
        optional = False
        nested: list[str] = []
        for arg in typing.get_args(hint):
            if arg is type(None):
                optional = True
                continue
            more, opt, inner = _describe(arg)
            kinds |= more
            optional = optional or opt
            nested += inner
        return kinds, optional, nested
    if origin is typing.Literal:
        return {SCALARS.get(type(v), "any") for v in typing.get_args(hint)}, None in typing.get_args(hint), []
    base = origin or hint
    if base in SCALARS:
        return {SCALARS[base]}, False, []
    if isinstance(base, type) and dataclasses.is_dataclass(base):
        return {"dataclass"}, False, [f"{base.__module__}.{base.__qualname__}"]
    if (isinstance(base, type) and issubclass(base, Mapping)) or _named(base, "DictConfig"):
        return {"dict"}, False, []
    if (isinstance(base, type) and issubclass(base, Sequence | set) and base is not str) or _named(
        base, "ListConfig"
    ):
        return {"list"}, False, []
    return {"any"}, False, []


def _named(base: Any, name: str) -> bool:
    return getattr(base, "__name__", None) == name


def _default(f: Any) -> str | None:
    import dataclasses

    if f.default is not dataclasses.MISSING:
        value = f.default
        return json.dumps(value) if isinstance(value, str) else repr(value)
    if f.default_factory is not dataclasses.MISSING:
        return "(factory)"
    return None


__all__ = [
    "SCHEMA_FILE",
    "SchemaField",
    "generate_schema",
    "is_shipped_verl",
    "load_schema",
    "ship_schema",
    "shipped_schema",
    "source_digest",
]

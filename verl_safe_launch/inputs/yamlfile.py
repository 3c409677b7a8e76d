"""YAML reading with the line of every key, using OmegaConf's own YAML loader (so types match Hydra's)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from verl_safe_launch.config_view import nest
from verl_safe_launch.errors import InputError
from verl_safe_launch.files import read_text_input
from verl_safe_launch.inputs.read_budget import MAX_VALUES, charge, read_before, values_left


@dataclass(frozen=True)
class YamlLeaf:
    """One leaf of a YAML document: its dotted key path, value and 1-based line."""

    key: str
    value: Any
    line: int


@dataclass(frozen=True)
class YamlDoc:
    """A parsed YAML mapping with its leaves in document order."""

    data: dict[str, Any]
    leaves: tuple[YamlLeaf, ...]
    header: str


@functools.cache
def _loader_class() -> Any:
    """OmegaConf's loader rules (float resolver, no timestamps) on libyaml's parser when available."""
    from omegaconf._utils import get_yaml_loader

    rules = get_yaml_loader()
    base = getattr(yaml, "CSafeLoader", None)
    if base is None:
        return rules

    class Loader(base):  # type: ignore[misc,valid-type]
        yaml_implicit_resolvers = rules.yaml_implicit_resolvers

    return Loader


def read_yaml(path: Path, *, expand_dots: bool) -> YamlDoc:
    """Read a YAML file whose top level must be a mapping; raise InputError on any problem."""
    text = read_text_input(path, what="file", missing_fix="check the path passed to -c/--config")
    return parse_yaml(text, str(path), expand_dots=expand_dots)


def parse_yaml(text: str, name: str, *, expand_dots: bool) -> YamlDoc:
    """Parse YAML text; keys containing dots become nested when ``expand_dots`` is true."""
    loader = _loader_class()(text)
    try:
        node = loader.get_single_node()
        walker = _Walker(loader, name, expand_dots)
        if node is None:
            return YamlDoc({}, (), _header(text))
        _check_size(node, name)
        if not isinstance(node, yaml.MappingNode):
            line = node.start_mark.line + 1
            raise InputError(
                f"{name} must contain a mapping of keys to values, not a {_kind(node)}",
                where=f"{name}:{line}",
                fix="write one 'key: value' per line, e.g. 'data.train_batch_size: 64'",
            )
        data = walker.mapping(node, "")
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        raise InputError(f"malformed YAML in {name}: {exc.problem or exc}", where=where) from None
    except yaml.YAMLError as exc:
        raise InputError(f"malformed YAML in {name}: {exc}", where=name) from None
    finally:
        loader.dispose()
    return YamlDoc(data, tuple(walker.leaves), _header(text))


MAX_YAML_DEPTH = 100


def _check_size(root: yaml.Node, name: str) -> None:
    """Refuse a document that expands to more values than the read budget has left (an alias bomb, or the
    last of several files read by one composition) or refers to itself; charge the budget for it."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    limit = values_left()

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_YAML_DEPTH:
            raise InputError(
                f"{name} nests deeper than {MAX_YAML_DEPTH} levels (the limit)",
                where=f"{name}:{node.start_mark.line + 1}",
                fix="flatten the nesting",
            )
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            line = node.start_mark.line + 1
            raise InputError(
                f"{name} contains an alias that refers to itself",
                where=f"{name}:{line}",
                fix="remove the alias",
            )
        open_nodes.add(key)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > limit:
                raise _over_budget(name, node.start_mark.line + 1, limit)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    charge(size(root, 0), name)


def _over_budget(name: str, line: int, limit: int) -> InputError:
    before = read_before()
    if limit < MAX_VALUES and before:
        read = f"{len(before)} file(s) read before it ({', '.join(before[:3])}{', ...' if len(before) > 3 else ''})"
        return InputError(
            f"{name} passes the {MAX_VALUES:,} YAML values one composition may read (aliases count at every "
            f"use): {read} used {MAX_VALUES - limit:,} of them",
            where=f"{name}:{line}",
            fix="read fewer or smaller files (each -c file, the preset and verl's own config files count), "
            "without repeated '*alias' references",
        )
    return InputError(
        f"{name} expands to more than {MAX_VALUES:,} values (the limit; aliases count at every use)",
        where=f"{name}:{line}",
        fix="write the config out without repeated '*alias' references",
    )


def _header(text: str) -> str:
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# @package"):
            return stripped[len("# @package") :].strip()
        if stripped and not stripped.startswith("#"):
            break
    return ""


def _shown(node: yaml.Node) -> str:
    value = node.value if isinstance(node, yaml.ScalarNode) else "..."
    text = repr(value if len(value) <= 40 else value[:37] + "...")
    return text


def _kind(node: yaml.Node) -> str:
    return "list" if isinstance(node, yaml.SequenceNode) else "single value"


class _Walker:
    def __init__(self, loader: Any, name: str, expand_dots: bool) -> None:
        self.loader = loader
        self.name = name
        self.expand_dots = expand_dots
        self.leaves: list[YamlLeaf] = []

    def mapping(self, node: yaml.MappingNode, prefix: str) -> dict[str, Any]:
        self._walk(node, prefix)
        if self.expand_dots:
            return nest((leaf.key, leaf.value) for leaf in self.leaves)
        return dict(self._construct(node))

    def _construct(self, node: yaml.Node) -> Any:
        """A node's value; a tag the value does not fit (``!!float "abc"``, ``!!int "0xZZ"``) is an InputError."""
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, TypeError, OverflowError, ArithmeticError, AttributeError) as exc:
            # the constructors of YAML's own tags raise these on a value that does not fit the tag
            line = node.start_mark.line + 1
            tag = node.tag.rpartition(":")[2]
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(
                f"{self.name}:{line}: !!{tag} {_shown(node)} is not a valid {tag} ({detail})",
                where=f"{self.name}:{line}",
                fix=f"remove the '!!{tag}' tag, or write a value of that type",
            ) from None

    def _walk(self, node: yaml.MappingNode, prefix: str) -> None:
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(self._construct(key_node))
            line = key_node.start_mark.line + 1
            if key in seen:
                raise InputError(
                    f"duplicate key '{prefix}{key}' in {self.name} (lines {seen[key]} and {line})",
                    where=f"{self.name}:{line}",
                    fix=f"keep one of the two lines for '{prefix}{key}'",
                )
            seen[key] = line
            if isinstance(value_node, yaml.MappingNode) and value_node.value:
                self._walk(value_node, f"{prefix}{key}.")
            else:
                value = self._construct(value_node)
                self.leaves.append(YamlLeaf(f"{prefix}{key}", value, line))

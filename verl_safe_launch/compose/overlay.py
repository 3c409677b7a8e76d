"""The fast path of composition, for auditing many launches in one process: ``Overlay().compose(request)``.

It takes the same ``ComposeRequest`` as ``compose()`` and returns the same ``Composed``, except that the config
itself is not rebuilt (``Composed.cfg`` is None): these results serve checks and audits, never a launch.
verl's composed defaults come from ``compose()`` once per config-group choice; a request's key overrides
with literal values (``key=v``, ``+key=v``, ``++key=v``) are laid over their flattened view, and only the
interpolations that read a changed key are re-resolved. The writes, rejected overrides, values, key order and
provenance equal ``compose()``'s (tests/test_overlay.py checks every fixture script and random override
lists); a ``+``/``++`` key under an empty mapping or a null (``+...engine_kwargs.vllm.x=1``) opens it as
Hydra does. Anything else (user files, presets, deletions, mapping or interpolation values, subtree overrides)
goes through ``compose()`` itself.

Why it exists: ``compose()`` copies and re-resolves the whole config (~900 leaves) for every request, tens of
milliseconds each; auditing hundreds of scripts (``verl-safe-launch audit``, bench/audit.py) needs a few.
"""

from __future__ import annotations

import copy
import functools
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from verl_safe_launch.compose.engine import Composed, Rejected, compose
from verl_safe_launch.compose.interpolation import Resolver, Unsupported, absolute_key
from verl_safe_launch.config_view import MISSING, ConfigView, flatten, nest
from verl_safe_launch.errors import VslError
from verl_safe_launch.inputs import (
    ComposeRequest,
    OverrideToken,
    cli_tokens,
    split_tool_tokens,
    verl_cache,
    verl_config_dir,
)
from verl_safe_launch.provenance import Provenance, Write, writes_by_key

_TOKEN = re.compile(r"(\+\+|\+|~)?([A-Za-z_][\w\-]*(?:\.[A-Za-z_][\w\-]*)*)=(.*)", re.DOTALL)
_REF = re.compile(r"\$\{(?:oc\.select:)?\s*([^,}\s$]+)")


class _Fallback(Exception):
    """This request needs a full composition."""


@dataclass(frozen=True)
class _Base:
    composed: Composed
    raw: dict[str, Any]
    prefixes: frozenset[str]
    by_key: dict[str, list[Write]]
    dependents: dict[str, frozenset[str]]
    refs: dict[str, tuple[str, ...]]


class Overlay:
    """``compose()``'s fast path (see the module's doc); counts the fast and the full compositions it made."""

    def __init__(self) -> None:
        self._bases: dict[tuple[str, ...], _Base] = {}
        self._extended: dict[int, tuple[Composed, _Base]] = {}
        self.fast = 0
        self.full = 0

    def compose(self, request: ComposeRequest) -> Composed:
        """The composition of ``request`` (``compose(request)`` where the fast path does not apply)."""
        try:
            composed = self._fast(request)
            self.fast += 1
            return composed
        except _Fallback:
            self.full += 1
            return compose(request)

    def extend(self, composed: Composed, request: ComposeRequest, extra: Sequence[OverrideToken]) -> Composed:
        """``request`` with ``extra`` overrides after its own, where ``composed`` is ``compose(request)``: the extra
        overrides are laid over ``composed`` when they are literal key overrides, else all is composed again."""
        if composed.cfg is None:
            raise ValueError("extend() needs a full composition (compose(), not Overlay.compose())")
        if id(composed) not in self._extended:
            self._extended[id(composed)] = (composed, _index(composed))
        base = self._extended[id(composed)][1]
        try:
            state = _State(base, request.lenient)
            for token in extra:
                state.apply(token)
        except _Fallback:
            self.full += 1
            return compose(replace(request, overrides=(*request.overrides, *extra)))
        self.fast += 1
        return Composed(
            None,
            state.view(),
            (*composed.writes, *state.writes),
            composed.tool,
            (*composed.verl_overrides, *extra),
            (*composed.rejected, *state.rejected),
        )

    def _fast(self, request: ComposeRequest) -> Composed:
        if request.config_files or request.adapted or request.fills or request.preset:
            raise _Fallback
        verl_tokens, tool = split_tool_tokens(request.overrides)
        if tool.preset:
            raise _Fallback
        groups, plain = _split_groups(verl_tokens)
        base = self._base(tuple(t.text for t in groups), request.config_name)
        state = _State(base, request.lenient)
        for token in plain:
            state.apply(token)
        view = state.view()
        return Composed(
            None, view, (*base.composed.writes, *state.writes), tool, verl_tokens, tuple(state.rejected)
        )

    def _base(self, groups: tuple[str, ...], config_name: str) -> _Base:
        key = (config_name, *groups)
        if key not in self._bases:
            try:
                composed = compose(
                    ComposeRequest(overrides=cli_tokens(list(groups)), config_name=config_name)
                )
            except VslError:
                raise _Fallback from None
            self._bases[key] = _index(composed)
        return self._bases[key]


def _split_groups(tokens: Iterable[OverrideToken]) -> tuple[list[OverrideToken], list[OverrideToken]]:
    groups: list[OverrideToken] = []
    plain: list[OverrideToken] = []
    for token in tokens:
        key = token.text.partition("=")[0].lstrip("+~")
        if key in config_groups() or "/" in key or "@" in key:
            if token.text.startswith(("+", "~")):
                raise _Fallback
            groups.append(token)
        else:
            plain.append(token)
    return groups, plain


def plus_accepted(existing: Any, value: Any) -> bool:
    """Hydra 1.3's rule for ``+key=value``: the key holds nothing (absent, null, ``???``) or the value merges."""
    return existing is None or existing == MISSING or isinstance(value, dict | list)


@verl_cache
def config_groups() -> frozenset[str]:
    """verl's config groups (``model_engine``, ``actor``...): overrides of these choose files, not values."""
    return frozenset(p.name for p in verl_config_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def model_engines() -> tuple[str, ...]:
    """The choices of verl's ``model_engine`` config group (``dp``, ``megatron``...)."""
    folder = verl_config_dir() / "model_engine"
    return tuple(sorted(p.stem for p in folder.glob("*.yaml")))


def _index(composed: Composed) -> _Base:
    from omegaconf import OmegaConf

    raw = flatten(OmegaConf.to_container(composed.cfg, resolve=False))  # type: ignore[arg-type]
    prefixes = frozenset(k[:i] for k in raw for i, ch in enumerate(k) if ch == ".")
    by_key = writes_by_key(composed.writes)
    refs = {key: _refs(key, value) for key, value in raw.items() if isinstance(value, str) and "${" in value}
    dependents: dict[str, set[str]] = {}
    for key, targets in refs.items():
        for target in targets:
            dependents.setdefault(target, set()).add(key)
    frozen = {k: frozenset(v) for k, v in dependents.items()}
    return _Base(composed, raw, prefixes, by_key, frozen, refs)


def _refs(key: str, value: str) -> tuple[str, ...]:
    return tuple(absolute_key(key, target) for target in _REF.findall(value))


_SIMPLE_INT = re.compile(r"0|[1-9][0-9]*")
_SIMPLE_FLOAT = re.compile(r"(0|[1-9][0-9]*)(\.[0-9]+|(\.[0-9]+)?[eE][+-]?[0-9]+)")
_SIMPLE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIMPLE_PATH = re.compile(r"[A-Za-z0-9_\-.]*/[A-Za-z0-9_\-./]*")
_KEYWORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str) -> tuple[bool, Any]:
    """Hydra's reading of an override value; plain numbers, words, paths, booleans and null without its parser."""
    if _SIMPLE_INT.fullmatch(text):
        return True, int(text)
    if _SIMPLE_FLOAT.fullmatch(text):
        return True, float(text)
    if _SIMPLE_PATH.fullmatch(text):
        return True, text
    if _SIMPLE_WORD.fullmatch(text):
        lowered = text.lower()
        if lowered in _KEYWORDS:
            return True, _KEYWORDS[lowered]
        if lowered not in ("inf", "nan"):
            return True, text
    return _parse_with_hydra(text)


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


@functools.lru_cache(maxsize=8192)
def _parse_with_hydra(text: str) -> tuple[bool, Any]:
    """Hydra's own override parser on ``k=<text>`` (cached: values repeat across scripts)."""
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        override = _parser().parse_override(f"k={text}")
    except HydraException:
        return False, None
    if override.value_type is not ValueType.ELEMENT:
        return False, None
    value = override.value()
    ok = not isinstance(value, dict) and not (isinstance(value, str) and "${" in value)
    return ok, value


class _State:
    """The flat config being overlaid, the writes and rejections so far."""

    def __init__(self, base: _Base, lenient: bool) -> None:
        self.base = base
        self.lenient = lenient
        self.raw = dict(base.raw)
        self.writes: list[Write] = []
        self.rejected: list[Rejected] = []
        self.changed: list[str] = []
        self.added: list[str] = []
        self.replaced: dict[str, str] = {}
        """An empty (``{}`` or null) leaf a ``+``/``++`` key was added under → the first key added there."""

    def apply(self, token: OverrideToken) -> None:
        match = _TOKEN.fullmatch(token.text)
        if match is None or match.group(1) == "~":
            raise _Fallback
        prefix, key, text = match.group(1) or "", match.group(2), match.group(3)
        ok, value = parse_value(text)
        if not ok or key in self.base.prefixes or isinstance(self.raw.get(key), dict):
            raise _Fallback
        if self._under_leaf(key):
            self._open_leaf(key, prefix)
        exists = key in self.raw
        if prefix == "+" and isinstance(self.raw.get(key), str) and "${" in self.raw[key]:
            raise _Fallback
        if (prefix == "" and not exists) or (prefix == "+" and not plus_accepted(self.raw.get(key), value)):
            self._reject(token, key, exists)
            return
        if not exists:
            self.added.append(key)
        self.raw[key] = _copy(value)
        self.writes.append(Write(key, _copy(value), token.source))
        self.changed.append(key)

    def _under_leaf(self, key: str) -> bool:
        if key in self.raw:
            return False
        parts = key.split(".")
        return any(".".join(parts[:i]) in self.raw for i in range(1, len(parts)))

    def _open_leaf(self, key: str, prefix: str) -> None:
        """``+a.b.c=v`` where ``a.b`` is an empty mapping or null: Hydra makes ``a.b`` a mapping holding ``c``, in
        ``a.b``'s place. Anything else under a leaf (a value, an interpolation, a plain ``key=``) is composed in
        full."""
        parts = key.split(".")
        leaf = next(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in self.raw)
        if prefix not in ("+", "++") or self.raw[leaf] not in ({}, None):
            raise _Fallback
        del self.raw[leaf]
        self.replaced[leaf] = key

    def _reject(self, token: OverrideToken, key: str, exists: bool) -> None:
        if not self.lenient:
            raise _Fallback
        reason = (
            f"Could not append to config. An item is already at '{key}'."
            if exists
            else f"Could not override '{key}'."
        )
        self.rejected.append(Rejected(token, key, reason))

    def view(self) -> ConfigView:
        base_view = self.base.composed.view
        if not self.changed:
            return base_view
        first = set(self.replaced.values())
        values = _ordered(
            _renamed(base_view.values, self.replaced), [k for k in self.added if k not in first]
        )
        provenance = {k: v for k, v in base_view.provenance.items() if k not in self.replaced}
        for key in dict.fromkeys(self.changed):
            values[key] = _copy(self.raw[key])
            provenance[key] = self._provenance(key, values[key])
        for key, value in self._dependents().items():
            values[key] = value
            provenance[key] = replace(provenance[key], value=value)
        return ConfigView(values, provenance)

    def _provenance(self, key: str, value: Any) -> Provenance:
        chain = [*self.base.by_key.get(key, ()), *(w for w in self.writes if w.key == key)]
        return Provenance(key, value, chain[-1].source, tuple(chain[:-1]))

    def _dependents(self) -> dict[str, Any]:
        """Re-resolve the interpolations that (transitively) read a changed key, with OmegaConf itself."""
        changed = set(self.changed)
        todo = deque(t for key in changed for t in _self_and_parents(key))
        affected: set[str] = set()
        while todo:
            for dependent in self.base.dependents.get(todo.popleft(), ()):
                if dependent not in affected and dependent not in changed:
                    affected.add(dependent)
                    todo.append(dependent)
        if not affected:
            return {}
        resolver = Resolver(self.raw, self._leaves)
        try:
            return {key: resolver.value(key) for key in affected}
        except Unsupported:
            return _resolve(affected, self._closure(affected))

    def _closure(self, keys: set[str]) -> dict[str, Any]:
        needed: dict[str, Any] = {}
        todo = deque(keys)
        while todo:
            key = todo.popleft()
            for leaf in self._leaves(key):
                if leaf in needed:
                    continue
                needed[leaf] = self.raw[leaf]
                value = self.raw[leaf]
                if isinstance(value, str) and "${" in value:
                    todo.extend(_refs(leaf, value))
        return needed

    def _leaves(self, key: str) -> list[str]:
        if key in self.raw:
            return [key]
        if key in self.base.prefixes or any(k.startswith(key + ".") for k in self.added):
            dotted = key + "."
            return [k for k in self.raw if k.startswith(dotted)]
        return []


def _copy(value: Any) -> Any:
    return copy.deepcopy(value) if isinstance(value, list | dict) else value


def _self_and_parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _resolve(keys: set[str], needed: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    nested = nest((key, copy.deepcopy(value)) for key, value in needed.items())
    try:
        tree = OmegaConf.to_container(OmegaConf.create(nested), resolve=True)
    except OmegaConfBaseException:
        raise _Fallback from None
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = tree
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def _renamed(values: Mapping[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """``values`` with each key of ``renames`` replaced, in its place, by its new key (value set later)."""
    if not renames:
        return dict(values)
    return {renames.get(k, k): (None if k in renames else v) for k, v in values.items()}


def _ordered(values: dict[str, Any], added: list[str]) -> dict[str, Any]:
    """Place new keys where OmegaConf puts them: after the last leaf of their nearest existing parent."""
    if not added:
        return values
    keys = list(values)
    for key in added:
        parts = key.split(".")
        anchor = len(keys)
        for cut in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:cut]) + "."
            under = [i for i, k in enumerate(keys) if k.startswith(parent)]
            if under:
                anchor = under[-1] + 1
                break
        keys.insert(anchor, key)
    return {k: values.get(k) for k in keys}

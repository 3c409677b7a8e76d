"""Compose verl's config exactly as verl's Hydra entry point would, recording every value's provenance."""

from __future__ import annotations

import functools
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_safe_launch.compose import _hydra, cached_defaults
from verl_safe_launch.compose.applying import deepest_node, refusal, try_apply
from verl_safe_launch.compose.budget import check_interpolation_budget
from verl_safe_launch.compose.interpolation import Resolver, Unsupported, absolute_key
from verl_safe_launch.compose.layers import MAX_LAYER_KEYS, STRIPPED_FILE_KEYS, user_layers
from verl_safe_launch.config_view import ConfigView, flatten, format_value
from verl_safe_launch.errors import ConfigError, InputError, UsageError, VslError, collect
from verl_safe_launch.inputs import (
    PRIMARY_CONFIG,
    ComposeRequest,
    OverrideToken,
    ToolSettings,
    YamlDoc,
    cached_bytes,
    charge_verl_yaml,
    composition_budget,
    display_path,
    parse_override,
    read_yaml,
    split_tool_tokens,
    verl_config_dir,
)
from verl_safe_launch.provenance import Layer, Provenance, Source, Write, writes_by_key

_INTERP = re.compile(r"\$\{(?:oc\.select:)?\s*([^,}\s]+)")


@dataclass(frozen=True)
class Rejected:
    """An override Hydra refused, recorded instead of raised when composing leniently."""

    token: OverrideToken
    key: str
    reason: str


@dataclass(frozen=True)
class Composed:
    """The composed config (an OmegaConf DictConfig for verl), its flattened view and every write."""

    cfg: Any
    view: ConfigView
    writes: tuple[Write, ...]
    tool: ToolSettings
    verl_overrides: tuple[OverrideToken, ...] = field(default=())
    rejected: tuple[Rejected, ...] = field(default=())


def compose(request: ComposeRequest) -> Composed:
    """Build the final config from verl defaults, preset, user files and overrides, with provenance.

    verl's composed defaults are built once per process for each set of config-group choices
    (``model_engine=megatron``...) and copied for each composition; the layers above them are applied to the
    copy in Hydra's order, so the result equals Hydra's own ``compose()`` of the same overrides. Everything it
    reads (verl's config files, the preset, every -c file) shares one budget of YAML values.
    """
    with composition_budget():
        charge_verl_yaml()
        return _compose(request)


def _compose(request: ComposeRequest) -> Composed:
    from omegaconf import OmegaConf

    if len(request.overrides) > MAX_LAYER_KEYS:
        raise UsageError(
            f"{len(request.overrides):,} overrides in one launch, over the limit of {MAX_LAYER_KEYS:,}",
            fix="move the values into a YAML file (-c), one key per line",
        )
    verl_tokens, tool = split_tool_tokens(request.overrides)
    parsed = [(parse_override(t), t) for t in verl_tokens]
    base, config_overrides = _verl_base(parsed, verl_tokens, request.config_name)
    cfg = base.private_cfg()
    writes = list(base.writes)
    preset_name = request.preset or (tool.preset[0] if tool.preset else None)
    for layer_writes in user_layers(preset_name, tool, request):
        for write in layer_writes:
            _set(cfg, write)
        writes.extend(layer_writes)
    OmegaConf.set_struct(cfg, True)
    rejected: list[Rejected] = []
    for override, token in config_overrides:
        reason = try_apply(cfg, override, token, lenient=request.lenient)
        if reason is not None:
            rejected.append(Rejected(token, override.key_or_group, reason))
            continue
        writes.extend(_override_writes(override, token))
    _apply_fills(cfg, request.fills, writes)
    view = build_view(cfg, writes)
    return Composed(cfg, view, tuple(writes), tool, verl_tokens, tuple(rejected))


@dataclass(frozen=True)
class _Base:
    """verl's composed defaults for one set of config-group choices, and the writes of verl's YAML files."""

    cfg: Any
    writes: tuple[Write, ...]
    pickled: bytes

    @classmethod
    def of(cls, cfg: Any, writes: tuple[Write, ...]) -> _Base:
        return cls(cfg, writes, pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL))

    def private_cfg(self) -> Any:
        """A copy of the config for one composition: unpickled, several times faster than ``copy.deepcopy``."""
        return pickle.loads(self.pickled)


_BASES: dict[tuple[str, ...], _Base] = {}
"""verl's composed defaults per verl config dir and config-group choices (the overrides' text); never mutated."""
_REFUSED: dict[tuple[str, ...], str] = {}
"""Hydra's refusal of group choices it cannot compose: a folder's scripts naming the same missing option."""


def _verl_base(
    parsed: list[tuple[Any, OverrideToken]],
    tokens: Sequence[OverrideToken],
    config_name: str = PRIMARY_CONFIG,
) -> tuple[_Base, list[tuple[Any, OverrideToken]]]:
    """verl's defaults under ``config_name`` and the group choices among ``parsed`` (cached), and the overrides
    left to apply."""
    from hydra.errors import HydraException

    try:
        config_ids = {id(o) for o in _hydra.config_overrides([o for o, _ in parsed])}
        groups = [o for o, _ in parsed if id(o) not in config_ids]
        _refuse_group_values([(o, t) for o, t in parsed if id(o) not in config_ids])
        key = (str(verl_config_dir()), config_name, *(o.input_line for o in groups))
        if key not in _BASES and key not in _REFUSED:
            try:
                _BASES[key] = _compose_verl(groups, config_name)
            except (HydraException, ValueError) as exc:
                _REFUSED[key] = str(exc)
        if key in _REFUSED:
            raise ValueError(_REFUSED[key])
    except (HydraException, ValueError) as exc:
        raise ConfigError(
            f"cannot compose verl's config: {str(exc).splitlines()[0]}",
            where=_token_mentioned(str(exc), tokens),
            fix=_group_fix(),
        ) from None
    return _BASES[key], [(o, t) for o, t in parsed if id(o) in config_ids]


def _group_fix() -> str:
    """Name the options this verl has for its model_engine group (none before 0.7)."""
    options = sorted(p.stem for p in (verl_config_dir() / "model_engine").glob("*.yaml"))
    if not options:
        return "this verl has no model_engine group: choose the engine with its config (--config-name)"
    return f"choose an option this verl has (model_engine={'|'.join(options)})"


def _refuse_group_values(groups: list[tuple[Any, OverrideToken]]) -> None:
    """A config group takes option names: ``data=[1,2]`` would crash Hydra's defaults list, not compose."""
    for override, token in groups:
        value = override.value()
        if override.is_delete() or value is None:
            continue  # '~data' and 'data=null' are reported where the config is checked
        names = value if isinstance(value, list) else [value]
        if not all(isinstance(name, str) for name in names):
            key = override.get_key_element().lstrip("+~")
            raise UsageError(
                f"'{token.text}': {key} is one of verl's config groups, which takes the name of a config file, "
                f"not {format_value(value)}",
                where=token.source.describe(),
                fix=f"set keys below it instead ({key}.KEY=VALUE)",
            )


def _token_mentioned(message: str, tokens: Sequence[OverrideToken]) -> str | None:
    for token in tokens:
        key = token.text.lstrip("+~").partition("=")[0]
        if key and key in message:
            return token.source.describe()
    return None


def _compose_verl(group_overrides: list[Any], config_name: str = PRIMARY_CONFIG) -> _Base:
    """verl's defaults under the group choices: from the on-disk cache of the verl in use, else composed."""

    def fresh() -> bytes:
        return cached_defaults.to_bytes(*_compose_fresh(group_overrides, config_name))

    named = [] if config_name == PRIMARY_CONFIG else [f"--config-name={config_name}"]
    name = cached_defaults.defaults_name([*named, *(o.input_line for o in group_overrides)])
    cfg, writes = cached_defaults.from_bytes(cached_bytes(name, fresh))
    return _Base.of(cfg, writes)


def _compose_fresh(group_overrides: list[Any], config_name: str) -> tuple[Any, tuple[Write, ...]]:
    cfg, entries = _hydra.compose_defaults(group_overrides, config_name)
    with composition_budget():  # verl's files were counted (charge_verl_yaml): read again for their lines
        writes = _verl_writes(entries)
    return cfg, tuple(writes)


def _verl_writes(entries: Sequence[Any]) -> list[Write]:
    writes: list[Write] = []
    for entry in entries:
        path = verl_config_dir() / f"{entry.config_path}.yaml"
        if not path.is_file():
            continue
        doc = _read_verl_yaml(path, path.stat().st_mtime_ns)
        prefix = f"{entry.package}." if entry.package else ""
        source_file = display_path(path.resolve())
        for leaf in doc.leaves:
            top = leaf.key.split(".", 1)[0]
            if top in STRIPPED_FILE_KEYS:
                continue
            writes.append(Write(prefix + leaf.key, leaf.value, Source(Layer.VERL, source_file, leaf.line)))
    return writes


@functools.lru_cache(maxsize=256)
def _read_verl_yaml(path: Path, mtime_ns: int) -> YamlDoc:
    return read_yaml(path, expand_dots=False)


def _set(cfg: Any, write: Write) -> None:
    """Write one value of a file, preset or fill; a value of the wrong shape for its node is an InputError."""
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    try:
        with open_dict(cfg):
            OmegaConf.update(cfg, write.key, write.value, merge=True, force_add=True)
    except (OmegaConfBaseException, ValueError, TypeError, KeyError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        node = deepest_node(cfg, write.key)
        raise InputError(
            f"cannot set {write.key}={format_value(write.value)}: {detail}",
            where=write.source.describe(),
            fix=f"give {node} a value of the shape verl's config has there "
            f"(see 'verl-safe-launch show --key {node}')",
        ) from None


def require_accepted(composed: Composed) -> Composed:
    """Raise one error naming every override Hydra refused (a lenient composition collects them)."""
    if not composed.rejected:
        return composed
    errors: list[VslError] = []
    for r in composed.rejected:
        found = refusal(r.reason, r.key, r.token, composed.cfg)
        errors.append(found or UsageError(f"cannot apply override '{r.token.text}': {r.reason}"))
    raise collect(errors)


def _override_writes(override: Any, token: OverrideToken) -> list[Write]:
    key = override.key_or_group
    if override.is_delete():
        return [Write(key, None, token.source, delete=True)]
    value = override.value()
    if isinstance(value, dict) and value:
        return [Write(f"{key}.{k}", v, token.source) for k, v in flatten(value).items()]
    return [Write(key, value, token.source)]


def _apply_fills(cfg: Any, fills: tuple[Write, ...], writes: list[Write]) -> None:
    if not fills:
        return
    last = {w.key: w for w in writes}
    for fill in fills:
        current = last.get(fill.key)
        if current is None or current.source.layer is Layer.VERL:
            _set(cfg, fill)
            writes.append(fill)


def build_view(cfg: Any, writes: Sequence[Write]) -> ConfigView:
    """Flatten the composed config and attach each leaf's provenance from the recorded writes."""
    from omegaconf import OmegaConf

    raw = flatten(OmegaConf.to_container(cfg, resolve=False))  # type: ignore[arg-type]
    by_key = writes_by_key(writes)
    check_interpolation_budget(raw, lambda key: _set_by(key, by_key))
    resolved = _resolved(cfg, raw)
    provenance = {key: _provenance(key, resolved[key], raw[key], by_key) for key in raw}
    return ConfigView(resolved, provenance)


def _set_by(key: str, by_key: dict[str, list[Write]]) -> str | None:
    chain = by_key.get(key)
    return chain[-1].source.describe() if chain else None


def _resolved(cfg: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Every leaf's value with interpolations resolved, as OmegaConf resolves them.

    The interpolation forms verl's YAML uses are resolved on the flat leaves (OmegaConf parses each one with
    its ANTLR grammar, most of a composition's time); anything else goes to OmegaConf itself.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return _resolved_flat(raw)
    except Unsupported:
        pass
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
        return {key: _lookup(tree, key) for key in raw}
    except OmegaConfBaseException:
        out: dict[str, Any] = {}
        for key, value in raw.items():
            try:
                out[key] = OmegaConf.select(cfg, key, throw_on_missing=False)
            except OmegaConfBaseException:
                out[key] = value
            if OmegaConf.is_config(out[key]):
                out[key] = OmegaConf.to_container(out[key], resolve=False)
        return out


def resolves_flat(cfg: Any) -> bool:
    """True when every interpolation resolves by the flat resolver (which gives up on anything it is unsure of)."""
    from omegaconf import OmegaConf

    try:
        _resolved_flat(flatten(OmegaConf.to_container(cfg, resolve=False)))  # type: ignore[arg-type]
    except Unsupported:
        return False
    return True


def _resolved_flat(raw: dict[str, Any]) -> dict[str, Any]:
    if any(isinstance(value, list | dict) and _has_interpolation(value) for value in raw.values()):
        raise Unsupported("interpolation inside a list or mapping")

    def leaves(prefix: str) -> list[str]:
        dotted = prefix + "."
        return [key for key in raw if key.startswith(dotted)]

    resolver = Resolver(raw, leaves)
    return {key: resolver.value(key) for key in raw}


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, list):
        return any(_has_interpolation(item) for item in value)
    if isinstance(value, dict):
        return any(_has_interpolation(item) for item in value.values())
    return False


def _lookup(tree: Any, key: str) -> Any:
    """The value at a dotted key; a dict key that itself holds dots (``{model.visual.blocks: {}}``) is one step."""
    parts = key.split(".")
    start = 0
    while start < len(parts):
        for end in range(start + 1, len(parts) + 1):
            name = ".".join(parts[start:end])
            if isinstance(tree, dict) and name in tree:
                tree, start = tree[name], end
                break
        else:
            raise KeyError(key)
    return tree


def _provenance(key: str, value: Any, raw: Any, by_key: dict[str, list[Write]]) -> Provenance:
    chain = list(by_key.get(key, ()))
    if not chain:
        chain = [Write(key, raw, Source(Layer.VERL, reason="created by verl's composition"))]
    last = chain[-1]
    interpolation = raw if isinstance(raw, str) and "${" in raw else None
    follows = _follows(key, interpolation) if interpolation else None
    return Provenance(key, value, last.source, tuple(chain[:-1]), interpolation, follows)


def _follows(key: str, interpolation: str) -> str | None:
    match = _INTERP.search(interpolation)
    if not match:
        return None
    return absolute_key(key, match.group(1))

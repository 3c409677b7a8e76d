"""Compose verl's config exactly as verl's Hydra entry point would, recording every value's provenance."""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_safe_launch.config_view import ConfigView, flatten
from verl_safe_launch.errors import ConfigError, UsageError, VslError, collect
from verl_safe_launch.inputs import (
    PRIMARY_CONFIG,
    ComposeRequest,
    OverrideToken,
    ToolSettings,
    YamlDoc,
    YamlLeaf,
    display_path,
    parse_override,
    read_yaml,
    split_tool_tokens,
    verl_config_dir,
)
from verl_safe_launch.provenance import Layer, Provenance, Source, Write

_STRIPPED_FILE_KEYS = ("defaults", "hydra")
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


def preset_dir() -> Path:
    """The shipped ``conf/preset`` directory (a Hydra config group inside the installed package)."""
    return Path(str(importlib.resources.files("verl_safe_launch.conf"))) / "preset"


def available_presets() -> list[str]:
    """Names of the presets shipped in ``conf/preset``."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def compose(request: ComposeRequest) -> Composed:
    """Build the final config from verl defaults, preset, user files and overrides, with provenance."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import OmegaConf

    verl_tokens, tool = split_tool_tokens(request.overrides)
    parsed = [(parse_override(t), t) for t in verl_tokens]
    loader, repo = _hydra_loader()
    defaults = _defaults_list(repo, [p for p, _ in parsed], verl_tokens)
    writes: list[Write] = []
    cfg = _compose_verl(loader, repo, defaults.defaults, writes)
    preset_name = request.preset or (tool.preset[0] if tool.preset else None)
    for layer_writes in _user_layers(preset_name, tool, request):
        for write in layer_writes:
            _set(cfg, write)
        writes.extend(layer_writes)
    OmegaConf.set_struct(cfg, True)
    sources = {id(p): t for p, t in parsed}
    rejected: list[Rejected] = []
    for override in defaults.config_overrides:
        token = sources[id(override)]
        reason = _try_apply(ConfigLoaderImpl, cfg, override, token, lenient=request.lenient)
        if reason is not None:
            rejected.append(Rejected(token, override.key_or_group, reason))
            continue
        writes.extend(_override_writes(override, token))
    _apply_fills(cfg, request.fills, writes)
    view = build_view(cfg, writes)
    return Composed(cfg, view, tuple(writes), tool, verl_tokens, tuple(rejected))


def _hydra_loader() -> tuple[Any, Any]:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import CachingConfigRepository
    from hydra._internal.utils import create_config_search_path

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(verl_config_dir())))
    return loader, CachingConfigRepository(loader.repository)


def _defaults_list(repo: Any, parsed: list[Any], tokens: Sequence[OverrideToken]) -> Any:
    from hydra._internal.defaults_list import create_defaults_list
    from hydra.errors import HydraException

    try:
        return create_defaults_list(
            repo=repo,
            config_name=PRIMARY_CONFIG,
            overrides_list=parsed,
            prepend_hydra=False,
            skip_missing=False,
        )
    except HydraException as exc:
        where = _token_mentioned(str(exc), tokens)
        raise ConfigError(
            f"cannot compose verl's config: {str(exc).splitlines()[0]}",
            where=where,
            fix="check the config group override (e.g. model_engine=dp|megatron|veomni|torchtitan)",
        ) from None


def _token_mentioned(message: str, tokens: Sequence[OverrideToken]) -> str | None:
    for token in tokens:
        key = token.text.lstrip("+~").partition("=")[0]
        if key and key in message:
            return token.source.describe()
    return None


def _compose_verl(loader: Any, repo: Any, defaults: list[Any], writes: list[Write]) -> Any:
    cfg = loader._compose_config_from_defaults_list(defaults=defaults, repo=repo)
    for default in defaults:
        if default.config_path is None:
            continue
        path = verl_config_dir() / f"{default.config_path}.yaml"
        if not path.is_file():
            continue
        doc = _read_verl_yaml(path, path.stat().st_mtime_ns)
        prefix = f"{default.package}." if default.package else ""
        source_file = display_path(path.resolve())
        for leaf in doc.leaves:
            top = leaf.key.split(".", 1)[0]
            if top in _STRIPPED_FILE_KEYS:
                continue
            writes.append(Write(prefix + leaf.key, leaf.value, Source(Layer.VERL, source_file, leaf.line)))
    return cfg


@functools.lru_cache(maxsize=256)
def _read_verl_yaml(path: Path, mtime_ns: int) -> YamlDoc:
    return read_yaml(path, expand_dots=False)


def _user_layers(preset: str | None, tool: ToolSettings, request: ComposeRequest) -> list[list[Write]]:
    layers: list[list[Write]] = []
    if preset:
        path = preset_dir() / f"{preset}.yaml"
        if not path.is_file():
            names = ", ".join(available_presets()) or "(none installed)"
            where = tool.preset[1].describe() if tool.preset else None
            raise ConfigError(f"unknown preset '{preset}'", where=where, fix=f"use one of: {names}")
        layers.append(_file_writes(path, Source(Layer.PRESET, name=preset), f"conf/preset/{preset}.yaml"))
    if request.adapted:
        layers.append(list(request.adapted))
    for path in request.config_files:
        layers.append(_file_writes(path, Source(Layer.FILE), str(path)))
    return layers


def _file_writes(path: Path, base: Source, shown: str) -> list[Write]:
    doc = read_yaml(path, expand_dots=True)
    leaves = [leaf for leaf in doc.leaves if leaf.key.split(".", 1)[0] not in _STRIPPED_FILE_KEYS]
    return [_leaf_write(leaf, base, shown) for leaf in leaves]


def _leaf_write(leaf: YamlLeaf, base: Source, shown: str) -> Write:
    source = Source(base.layer, shown, leaf.line, name=base.name, reason=base.reason)
    return Write(leaf.key, leaf.value, source)


def _set(cfg: Any, write: Write) -> None:
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        OmegaConf.update(cfg, write.key, write.value, merge=True, force_add=True)


def _apply_override(loader_cls: Any, cfg: Any, override: Any, token: OverrideToken) -> None:
    from hydra.errors import HydraException

    try:
        loader_cls._apply_overrides_to_config([override], cfg)
    except HydraException as exc:
        raise _override_error(exc, override, token, cfg) from None


def _try_apply(
    loader_cls: Any, cfg: Any, override: Any, token: OverrideToken, *, lenient: bool
) -> str | None:
    """Apply one override; when lenient, return Hydra's reason for a refused key instead of raising."""
    from hydra.errors import HydraException

    if not lenient:
        _apply_override(loader_cls, cfg, override, token)
        return None
    try:
        loader_cls._apply_overrides_to_config([override], cfg)
    except HydraException as exc:
        first = str(exc).splitlines()[0]
        if first.startswith(("Could not override", "Could not append")):
            return first
        raise _override_error(exc, override, token, cfg) from None
    return None


def _override_error(exc: Exception, override: Any, token: OverrideToken, cfg: Any) -> UsageError:
    first = str(exc).splitlines()[0]
    refusal = _refusal(first, override.key_or_group, token, cfg)
    if refusal is not None:
        return refusal
    cause = exc.__cause__
    detail = f"{first} ({cause})" if cause else first
    return UsageError(f"cannot apply override '{token.text}': {detail}", token.source.describe())


def _refusal(first: str, key: str, token: OverrideToken, cfg: Any) -> UsageError | None:
    """The user error for Hydra's refusal of a key (unknown key, '+' on an existing key), else None."""
    if first.startswith("Could not override"):
        hint = _did_you_mean(key, cfg)
        fix = f"did you mean '{hint}'?" if hint else f"if verl really reads it, add it with +{token.text}"
        return UsageError(f"unknown key '{key}': verl's config has no such key", token.source.describe(), fix)
    if first.startswith("Could not append"):
        return UsageError(
            f"'{key}' already exists, so '+' cannot add it",
            token.source.describe(),
            f"drop the '+': {token.text.lstrip('+')}",
        )
    return None


def require_accepted(composed: Composed) -> Composed:
    """Raise one error naming every override Hydra refused (a lenient composition collects them)."""
    if not composed.rejected:
        return composed
    errors: list[VslError] = []
    for r in composed.rejected:
        refusal = _refusal(r.reason, r.key, r.token, composed.cfg)
        errors.append(refusal or UsageError(f"cannot apply override '{r.token.text}': {r.reason}"))
    raise collect(errors)


def _did_you_mean(key: str, cfg: Any) -> str | None:
    from omegaconf import OmegaConf

    if cfg is None:
        return None
    known = list(flatten(OmegaConf.to_container(cfg, resolve=False)))  # type: ignore[arg-type]
    matches = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if matches:
        return matches[0]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0)
    return close[0] if close else None


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
    resolved = _resolved(cfg, raw)
    by_key = _writes_by_key(writes)
    provenance = {key: _provenance(key, resolved[key], raw[key], by_key) for key in raw}
    return ConfigView(resolved, provenance)


def _resolved(cfg: Any, raw: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

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


def _writes_by_key(writes: Sequence[Write]) -> dict[str, list[Write]]:
    by_key: dict[str, list[Write]] = {}
    for write in writes:
        by_key.setdefault(write.key, []).append(write)
    return by_key


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
    target = match.group(1)
    if not target.startswith("."):
        return target
    dots = len(target) - len(target.lstrip("."))
    parent = key.split(".")[:-dots]
    return ".".join([*parent, target.lstrip(".")])

"""The file layers above verl's defaults: the preset (shipped, or a YAML file of the user's own) and ``-c`` files."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from verl_safe_launch.errors import ConfigError, InputError
from verl_safe_launch.inputs import ComposeRequest, ToolSettings, YamlDoc, YamlLeaf, read_yaml
from verl_safe_launch.provenance import Layer, Source, Write

STRIPPED_FILE_KEYS = ("defaults", "hydra")
MAX_LAYER_KEYS = 2_000
"""The most keys one user file or one command line may set (verl's whole config has about 1,000 leaves)."""


def preset_dir() -> Path:
    """The shipped ``conf/preset`` directory (a Hydra config group inside the installed package)."""
    return Path(str(importlib.resources.files("verl_safe_launch.conf"))) / "preset"


def available_presets() -> list[str]:
    """Names of the presets shipped in ``conf/preset``."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def is_preset_path(name: str) -> bool:
    """``preset=PATH``: a name with a '/' is a YAML file of the user's own (``preset=./team.yaml``)."""
    return "/" in name


def preset_file(name: str, where: str | None) -> tuple[Path, str]:
    """The file of preset ``name`` and how messages show it: ``conf/preset/NAME.yaml``, or the user's PATH
    (PATH.yaml when PATH itself does not exist)."""
    if not is_preset_path(name):
        path = preset_dir() / f"{name}.yaml"
        if not path.is_file():
            names = ", ".join(available_presets()) or "(none installed)"
            raise ConfigError(f"unknown preset '{name}'", where=where, fix=f"use one of: {names}")
        return path, f"conf/preset/{name}.yaml"
    path = Path(name).expanduser()
    if not path.exists() and path.suffix not in (".yaml", ".yml"):
        path = path.with_name(path.name + ".yaml")
    if not path.exists():
        raise ConfigError(
            f"preset file not found: {name}",
            where=where,
            fix="give the path of a YAML file of verl keys (preset=./team.yaml), or one of: "
            + ", ".join(available_presets()),
        )
    return path, str(path)


def user_layers(preset: str | None, tool: ToolSettings, request: ComposeRequest) -> list[list[Write]]:
    """The writes of the preset, the hardware adaptations and each ``-c`` file, layer by layer."""
    layers: list[list[Write]] = []
    if preset:
        where = tool.preset[1].describe() if tool.preset else None
        path, shown = preset_file(preset, where)
        own = is_preset_path(preset)
        layers.append(file_writes(path, Source(Layer.PRESET, name=preset), shown, user=own, kind="a preset"))
    if request.adapted:
        layers.append(list(request.adapted))
    for path in request.config_files:
        user = path not in request.named_configs
        layers.append(file_writes(path, Source(Layer.FILE), str(path), user=user))
    return layers


def file_writes(
    path: Path, base: Source, shown: str, *, user: bool = False, kind: str = "a -c file"
) -> list[Write]:
    """One file's leaves as writes; a user's file (``user``) may not hold Hydra's keys or too many keys."""
    doc = read_yaml(path, expand_dots=True)
    if user:
        refuse_hydra_keys(doc, shown, kind)
        if len(doc.leaves) > MAX_LAYER_KEYS:
            raise InputError(
                f"{shown} sets {len(doc.leaves):,} keys, over the limit of {MAX_LAYER_KEYS:,} for one file",
                where=shown,
                fix="verl's whole config has about 1,000 keys: keep the ones this run changes",
            )
    leaves = [leaf for leaf in doc.leaves if leaf.key.split(".", 1)[0] not in STRIPPED_FILE_KEYS]
    return [_leaf_write(leaf, base, shown) for leaf in leaves]


_HYDRA_KEY_FIX = {
    "defaults": "delete the 'defaults:' list and select config groups on the command line "
    "(e.g. model_engine=megatron)",
    "hydra": "delete the 'hydra:' section: Hydra's own settings are not part of verl's config",
}


def refuse_hydra_keys(doc: YamlDoc, shown: str, kind: str = "a -c file") -> None:
    """A user layer holds verl keys only: a top-level ``defaults:`` or ``hydra:`` would be silently dropped."""
    for leaf in doc.leaves:
        top = leaf.key.split(".", 1)[0]
        if top in STRIPPED_FILE_KEYS:
            raise InputError(
                f"{shown}: the top-level '{top}:' is not applied from {kind} (it is Hydra's, not verl's)",
                where=f"{shown}:{leaf.line}",
                fix=_HYDRA_KEY_FIX[top],
            )


def _leaf_write(leaf: YamlLeaf, base: Source, shown: str) -> Write:
    source = Source(base.layer, shown, leaf.line, name=base.name, reason=base.reason)
    return Write(leaf.key, leaf.value, source)

"""Every call into Hydra's private API, in one place (Hydra 1.3's ``hydra._internal``).

Hydra's public ``compose()`` returns the config without saying which file or argument wrote each value, so
composition runs Hydra's own steps one by one: the split of overrides into group choices and config overrides,
the defaults list (which files verl's config groups choose), the composition of those files, and the
application of the config overrides. If Hydra moves or renames one of these, this module is the only one to
change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.inputs import PRIMARY_CONFIG, verl_cache, verl_config_dir


@dataclass(frozen=True)
class DefaultsEntry:
    """One config file of verl's defaults list: its path under the config dir (no suffix) and its package."""

    config_path: str
    package: str


@verl_cache
def _loader() -> Any:
    """Hydra's config loader for verl's config dir (built once per process; it reads no file until asked)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    return ConfigLoaderImpl(config_search_path=create_config_search_path(str(verl_config_dir())))


def config_overrides(overrides: Sequence[Any]) -> list[Any]:
    """The overrides Hydra applies to the composed config, as opposed to those choosing config-group files.

    Hydra's own split: an override is a group choice when its key names a config group and its value is not
    a mapping. Raises ``HydraException`` where Hydra would refuse the list (``+model_engine=...``).
    """
    from hydra._internal.defaults_list import Overrides

    return list(Overrides(_loader().repository, list(overrides)).config_overrides)


def compose_defaults(
    group_overrides: Sequence[Any], config_name: str = PRIMARY_CONFIG
) -> tuple[Any, tuple[DefaultsEntry, ...]]:
    """verl's config composed from ``config_name``'s defaults list under the group choices, and that list's files.

    Like Hydra, each composition reads the files through a caching repository of its own: Hydra's composition
    may edit the configs that repository caches (it merges schemas into them, merges their nodes without
    copying and strips their defaults lists), so one is never shared between two compositions.
    Raises ``HydraException`` for a choice Hydra refuses (an unknown option of a group).
    """
    from hydra._internal.config_repository import CachingConfigRepository
    from hydra._internal.defaults_list import create_defaults_list

    loader = _loader()
    repo = CachingConfigRepository(loader.repository)
    result = create_defaults_list(
        repo=repo,
        config_name=config_name,
        overrides_list=list(group_overrides),
        prepend_hydra=False,
        skip_missing=False,
    )
    cfg = loader._compose_config_from_defaults_list(defaults=result.defaults, repo=repo)
    entries = tuple(
        DefaultsEntry(d.config_path, d.package or "") for d in result.defaults if d.config_path is not None
    )
    return cfg, entries


def apply_override(override: Any, cfg: Any) -> None:
    """Apply one parsed override to ``cfg`` exactly as Hydra applies command-line overrides.

    Raises ``HydraException`` (``Could not override ...``, ``Could not append ...``) where Hydra refuses it.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config([override], cfg)

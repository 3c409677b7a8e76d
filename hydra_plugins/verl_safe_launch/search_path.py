"""Adds verl-safe-launch's config directory to every Hydra app's search path, so ``+preset=NAME`` resolves."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VerlSafeLaunchSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://verl_safe_launch.conf`` (the ``preset`` config group) to the search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        """Append the package's config directory after the application's own."""
        search_path.append(provider="verl-safe-launch", path="pkg://verl_safe_launch.conf")

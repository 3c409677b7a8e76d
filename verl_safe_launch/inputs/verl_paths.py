"""Locate the installed verl package and its trainer config without importing verl."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from verl_safe_launch.errors import ConfigError

PRIMARY_CONFIG = "ppo_trainer"


@functools.cache
def verl_package_dir() -> Path:
    """The directory of the installed ``verl`` package (``find_spec`` does not run ``verl/__init__``)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "verl is not installed in this Python environment",
            fix="pip install 'verl[verl-core]==0.9.1' (install torch==2.13.0 first)",
        )
    return Path(spec.origin).parent


def verl_config_dir() -> Path:
    """verl's Hydra config directory, ``verl/trainer/config``."""
    return verl_package_dir() / "trainer" / "config"


def display_path(path: Path) -> str:
    """A file inside verl shown relative to site-packages (``verl/trainer/config/...``), others as given."""
    root = verl_package_dir().parent
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)

"""Locate the verl package a launch will import (installed, or a copy chosen with ``--verl``) without importing it."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from verl_safe_launch.errors import ConfigError

PRIMARY_CONFIG = "ppo_trainer"
VERL_ENV = "VSL_VERL"
"""A directory holding a ``verl`` package (or the package itself): the verl every check is made for."""

F = TypeVar("F", bound=Callable[..., Any])
_CACHED: list[Any] = []
_CHOSEN: dict[str, tuple[Path, str]] = {}
_WARNINGS: dict[str, str] = {}


def verl_cache(fn: F) -> F:
    """``functools.cache`` for facts read from the verl in use; cleared when another verl is chosen."""
    cached = functools.cache(fn)
    _CACHED.append(cached)
    return cached  # type: ignore[return-value]


def package_in(directory: Path) -> Path | None:
    """The ``verl`` package at ``directory`` itself or directly inside it, if there is one."""
    for candidate in (directory, directory / "verl"):
        if candidate.name == "verl" and (candidate / "__init__.py").is_file():
            return candidate.resolve()
    return None


def choose_verl(
    directory: Path | None, origin: str = "--verl", scope: str = "user", warning: str | None = None
) -> None:
    """Make ``directory``'s verl the one every later check reads (``None``: forget the choice of ``scope``).

    ``scope`` is ``user`` (``--verl``) or ``project`` (the copy a script's or a directory's project uses: vendored,
    pinned); the user's wins. ``warning`` says what was passed over on the way (a vendored copy that cannot be
    read, a pinned release that could not be fetched); it is shown with the verl chosen.
    """
    _CHOSEN.pop(scope, None)
    _WARNINGS.pop(scope, None)
    if warning:
        _WARNINGS[scope] = warning
    if directory is not None:
        package = package_in(directory)
        if package is None:
            raise ConfigError(
                f"no verl package in {directory}",
                where=origin,
                fix="give a directory that holds verl/__init__.py (a source checkout or a pip --target dir)",
            )
        _CHOSEN[scope] = (package, origin)
    for cached in _CACHED:
        cached.cache_clear()


def chosen_verl(scope: str) -> tuple[Path, str] | None:
    """The verl package ``scope`` (``user`` or ``script``) chose, and how, if it chose one."""
    return _CHOSEN.get(scope)


@verl_cache
def verl_origin() -> tuple[Path, str]:
    """The verl package in use and how it was found: the user's choice, the project's, else the installed one."""
    return user_verl() or _CHOSEN.get("project") or installed_verl()


def verl_warning() -> str | None:
    """What was passed over while choosing the project's verl (None: nothing, or the user named one)."""
    return None if user_verl() else _WARNINGS.get("project")


def user_verl() -> tuple[Path, str] | None:
    """The verl the user named: ``--verl DIR``, else ``VSL_VERL`` (None: neither)."""
    if "user" in _CHOSEN:
        return _CHOSEN["user"]
    if os.environ.get(VERL_ENV):
        package = package_in(Path(os.environ[VERL_ENV]).expanduser())
        if package is None:
            raise ConfigError(
                f"no verl package in {os.environ[VERL_ENV]}",
                where=f"environment variable {VERL_ENV}",
                fix=f"point {VERL_ENV} at a directory that holds verl/__init__.py, or unset it",
            )
        return package, VERL_ENV
    return None


def installed_verl() -> tuple[Path, str]:
    """The ``verl`` that ``python`` would import here, found without importing it."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "verl is not installed in this Python environment",
            fix="pip install 'verl[verl-core]==0.9.1' (install torch==2.13.0 first), or give --verl DIR",
        )
    package = Path(spec.origin).parent
    return package, "installed" if package.parent.name in ("site-packages", "dist-packages") else "PYTHONPATH"


def verl_package_dir() -> Path:
    """The directory of the ``verl`` package in use (``find_spec`` does not run ``verl/__init__``)."""
    return verl_origin()[0]


def verl_config_dir() -> Path:
    """verl's Hydra config directory, ``verl/trainer/config``."""
    return verl_package_dir() / "trainer" / "config"


def display_path(path: Path) -> str:
    """A file inside verl shown relative to the directory above the package (``verl/trainer/config/...``)."""
    root = verl_package_dir().parent
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)

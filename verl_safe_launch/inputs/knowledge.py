"""Facts derived from the verl in use, cached on disk under the user's cache dir, keyed by its version and files."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_safe_launch.files import read_input
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_package_dir

CACHE_ENV = "VSL_CACHE_DIR"
"""Overrides the cache directory (default ``$XDG_CACHE_HOME/verl-safe-launch``, else ``~/.cache/...``)."""
FORMAT = 1
"""Bumped when the shape of a cached fact changes, so old entries are never read."""


def cache_root() -> Path:
    """Where cached knowledge lives: ``$VSL_CACHE_DIR``, else ``$XDG_CACHE_HOME/verl-safe-launch``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "verl-safe-launch"


def read_version(package: Path) -> str | None:
    """The release a verl package declares (``verl/version/version``), or None for a copy without one."""
    try:
        return (package / "version" / "version").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


@verl_cache
def fingerprint() -> str:
    """A hash of the verl in use: its config files' contents and its Python files' sizes and times."""
    package = verl_package_dir()
    digest = hashlib.sha256(f"{FORMAT}:{read_version(package)}".encode())
    for path in sorted((package / "trainer" / "config").rglob("*.yaml")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(read_input(path, what="verl config file", where=str(path)))
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "tests"))
        for name in sorted(f for f in files if f.endswith(".py")):
            stat = os.stat(os.path.join(root, name))
            digest.update(
                f"{os.path.relpath(root, package)}/{name}:{stat.st_size}:{stat.st_mtime_ns}".encode()
            )
    return digest.hexdigest()[:16]


def knowledge_dir() -> Path:
    """The cache directory of the verl in use: ``verl-<version>-<fingerprint>``."""
    return cache_root() / f"verl-{read_version(verl_package_dir()) or 'unknown'}-{fingerprint()}"


def cached_fact(name: str, produce: Callable[[], Any]) -> Any:
    """The JSON fact ``name`` of the verl in use, produced once and then read from the cache.

    A cache that cannot be written (read-only home, full disk) is skipped: the fact is produced every time.
    """
    path = knowledge_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    value = produce()
    _write(path, json.dumps(value).encode())
    return value


def cached_bytes(name: str, produce: Callable[[], bytes]) -> bytes:
    """Like ``cached_fact`` for bytes (a pickled composed config, which loads far faster than it is built)."""
    path = knowledge_dir() / name
    try:
        return path.read_bytes()
    except OSError:
        pass
    value = produce()
    _write(path, value)
    return value


def cached_json(relative: str, produce: Callable[[], Any]) -> tuple[Any, bool]:
    """A JSON fact that does not depend on verl (what a model's own code gives), under the cache root at
    ``relative``, produced once: the value and whether it was read from the cache. An unwritable cache is skipped."""
    path = cache_root() / relative
    try:
        return json.loads(path.read_text(encoding="utf-8")), True
    except (OSError, ValueError):
        pass
    value = produce()
    _write(path, json.dumps(value, sort_keys=True).encode())
    return value, False


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed); a failure is ignored."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, suffix=".tmp", delete=False) as handle:
            handle.write(data)
        os.replace(handle.name, path)
    except OSError:
        pass

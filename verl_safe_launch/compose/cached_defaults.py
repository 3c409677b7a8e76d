"""verl's composed defaults per config-group choice, stored so a new process loads them instead of recomposing.

The entry lives in the knowledge cache of the verl in use (keyed by its release and a hash of its files), in
the user's own cache directory; it is a pickle of the composed config and the writes of verl's YAML files.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from verl_safe_launch.provenance import Write

FORMAT = 1


def defaults_name(group_lines: Sequence[str]) -> str:
    """The cache entry of one set of group choices: ``defaults-<hash>.pickle``."""
    digest = hashlib.sha256("\n".join([str(FORMAT), *group_lines]).encode()).hexdigest()[:16]
    return f"defaults-{digest}.pickle"


def to_bytes(cfg: Any, writes: Sequence[Write]) -> bytes:
    """The composed config (interpolations unresolved) and the writes of verl's YAML files."""
    return pickle.dumps((cfg, tuple(writes)), protocol=pickle.HIGHEST_PROTOCOL)


def from_bytes(data: bytes) -> tuple[Any, tuple[Write, ...]]:
    """The config and writes ``to_bytes`` stored."""
    cfg, writes = pickle.loads(data)
    return cfg, tuple(writes)

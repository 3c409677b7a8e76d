"""The Python that runs verl-safe-launch must have its dependencies; say which ones it lacks, and where."""

from __future__ import annotations

import importlib.util
import socket
import sys

from verl_safe_launch.errors import LaunchError

REQUIRED = {"omegaconf": "omegaconf", "hydra": "hydra-core", "yaml": "pyyaml"}
"""Modules imported on every path (module → the package that installs it)."""


MISSING_MARK = "which verl-safe-launch needs"
MISSING_FIX = (
    "install verl-safe-launch with its dependencies into the Python that runs the cluster's Ray (pip install "
    "verl-safe-launch), or start Ray from an environment that has them"
)


class MissingDependency(LaunchError):
    """This Python lacks a package verl-safe-launch or verl needs (a cluster node's environment, usually)."""


def missing_modules() -> list[str]:
    """The required top-level modules this Python cannot import."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def missing_dependency(modules: list[str]) -> MissingDependency:
    """The error for modules this Python lacks: which Python, on which host, and what to install."""
    packages = " ".join(REQUIRED.get(m, m) for m in modules)
    return MissingDependency(
        f"this Python lacks {', '.join(repr(m) for m in modules)}, {MISSING_MARK}",
        where=f"{sys.executable} on {socket.gethostname()} (on a Ray job: the Python on the head node's PATH)",
        fix=f"install verl-safe-launch with its dependencies into that Python (pip install {packages}, or "
        "pip install verl-safe-launch), or start the cluster's Ray from an environment that has them",
    )

"""The run directory: where a launch records its config, overrides, provenance, pre-flight and command."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from verl_safe_launch.compose import Composed
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import UsageError
from verl_safe_launch.files import (
    check_text_name,
    ensure_directory,
    make_directory,
    write_atomic,
    write_files,
)
from verl_safe_launch.findings import Finding
from verl_safe_launch.launch.plan import LaunchBlocked
from verl_safe_launch.render import json_document, json_text
from verl_safe_launch.secret import redact

DEFAULT_ROOT = Path("outputs")
RUN_DIR_MODE = 0o700
"""A run directory this makes is its owner's alone: it records the config, the command and the logs of a run,
often on a shared file system."""
CONFIG_FILE = "config.yaml"
RUN_FILES = ("config.yaml", "overrides.txt", "provenance.json", "preflight.json", "command.sh")
# Environment variables that decide where and how a launch runs; command.sh exports them when set.
LAUNCH_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE")


@dataclass(frozen=True)
class RunRecord:
    """Everything the run directory records, already rendered to text (except the config)."""

    config_yaml: str
    overrides: tuple[str, ...]
    provenance: Mapping[str, Any]
    preflight: Mapping[str, Any]
    command: str


def auto_run_dir(now: datetime, root: Path = DEFAULT_ROOT) -> Path:
    """Create Hydra's ``outputs/<date>/<time>``; a suffix keeps two launches in one second apart.

    The directory is made with one ``mkdir`` (no exist_ok), so two launches never share it.
    """
    return make_directory(root / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S"), mode=RUN_DIR_MODE)


def prepare_run_dir(path: Path, *, force: bool) -> Path:
    """Create the run directory; refuse a file, or a non-empty directory unless forced."""
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"run directory {path} exists and is not a directory", "--run-dir", "choose another path"
        )
    if is_non_empty(path) and not force:
        raise UsageError(
            f"run directory {path} is not empty",
            where="--run-dir",
            fix="choose a new --run-dir, or pass --force to write into it (same-named files are replaced)",
        )
    ensure_directory(path, mode=RUN_DIR_MODE)
    return path


def run_dir_arg(text: str) -> Path:
    """The ``--run-dir`` argument; an empty or blank one (an unset shell variable) is refused, not taken as '.'."""
    if not text.strip():
        raise UsageError(
            f"--run-dir {text!r} is empty",
            where="--run-dir",
            fix="name a directory (is a shell variable unset?)",
        )
    check_text_name(text, where="--run-dir")
    return Path(text)


def is_non_empty(path: Path) -> bool:
    """True for an existing directory with anything in it."""
    return path.is_dir() and any(path.iterdir())


def render_config(cfg: Any) -> str:
    """The resolved config as YAML: what config.yaml holds and what verl's task runner receives, each secret's
    value as ``${oc.env:NAME}`` (the same text in the task runner, whose environment holds the same secrets)."""
    from omegaconf import OmegaConf

    return redact(str(OmegaConf.to_yaml(cfg, resolve=True, sort_keys=False)))


def config_digest(text: str) -> str:
    """SHA-256 of a rendered config."""
    return hashlib.sha256(text.encode()).hexdigest()


def reproduce_command(args: Sequence[str], cwd: Path, env: Mapping[str, str]) -> str:
    """A bash script that reruns this launch: same directory, Ray environment, interpreter and arguments."""
    lines = [
        "#!/usr/bin/env bash",
        "# Reruns this launch: same working directory, environment for Ray, interpreter and arguments.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(cwd))}",
    ]
    lines += [f"export {name}={shlex.quote(env[name])}" for name in LAUNCH_ENV if env.get(name)]
    command = [sys.executable, "-m", "verl_safe_launch", "run", *args]
    lines.append(" ".join(shlex.quote(part) for part in command))
    return "\n".join(lines) + "\n"


def write_run_files(run_dir: Path, record: RunRecord, inputs: Sequence[Path | str] = ()) -> None:
    """Write every run file atomically (a reader never sees a half-written file); ``inputs`` are never replaced."""
    files = {
        run_dir / CONFIG_FILE: (record.config_yaml, 0o644),
        run_dir / "overrides.txt": ("".join(f"{text}\n" for text in record.overrides), 0o644),
        run_dir / "provenance.json": (json_text(record.provenance), 0o644),
        run_dir / "preflight.json": (json_text(record.preflight), 0o644),
        run_dir / "command.sh": (record.command, 0o755),
    }
    write_files(files, force=True, inputs=inputs, where="run directory", keep_mode=False)


def atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write through a private temp file in the same directory, then rename it over ``path`` (a regular file)."""
    write_atomic(path, text, force=True, mode=mode, where="run directory", keep_mode=False)


def provenance_json(view: ConfigView) -> dict[str, Any]:
    """Every leaf's value, source and the values it replaced (the data behind ``show --origin``)."""
    return json_document({"keys": [prov.to_json() for prov in view.provenance.values()]})


def preflight_json(findings: Sequence[Finding], forced: Sequence[str]) -> dict[str, Any]:
    """The pre-flight outcome in the shape of ``check --format json``, and why the launch went ahead anyway
    when it was forced."""
    return json_document({"forced": list(forced)}, findings)


def resolved_config(composed: Composed) -> Any:
    """A resolved copy of the composed config: what config.yaml holds and what verl receives."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = copy.deepcopy(composed.cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        first = str(exc).splitlines()[0]
        raise LaunchBlocked(
            f"the config does not resolve: {first}", fix="run 'verl-safe-launch check'"
        ) from None
    return cfg


def choose_run_dir(run_dir: Path | None, force: bool, forced: list[str]) -> Path:
    """The run directory: --run-dir, else outputs/<date>/<time>; a non-empty one only with --force (recorded
    in ``forced``)."""
    if run_dir is None:
        return auto_run_dir(datetime.now())
    if is_non_empty(run_dir) and force:
        forced.append("non-empty run directory")
    return prepare_run_dir(run_dir, force=force)


@contextlib.contextmanager
def created_run_dir(run_dir: Path | None, force: bool, forced: list[str]) -> Iterator[Path]:
    """``choose_run_dir`` for the block that writes it: a directory this made is removed again when the block
    fails or is interrupted before anything is in it, so no empty run directory is left behind."""
    existed = run_dir is not None and run_dir.is_dir()
    path = choose_run_dir(run_dir, force, forced)
    try:
        yield path
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                path.rmdir()  # only an empty directory goes
        raise


def write_run_dir(
    run_dir: Path,
    cfg: Any,
    composed: Composed,
    findings: Sequence[Finding],
    args: Sequence[str],
    overrides: list[str],
    forced: list[str],
    inputs: Sequence[str],
) -> None:
    """config.yaml, overrides, provenance, the pre-flight report and the reproducing command."""
    record = RunRecord(
        config_yaml=render_config(cfg),
        overrides=tuple(overrides),
        provenance=provenance_json(composed.view),
        preflight=preflight_json(findings, forced),
        command=reproduce_command(args, Path.cwd(), os.environ),
    )
    write_run_files(run_dir, record, inputs)

"""Data files: local training and validation files exist, and a parquet file has the prompt column."""

from __future__ import annotations

import functools
import stat
from pathlib import Path

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import RuleContext
from verl_safe_launch.files import kind_of
from verl_safe_launch.findings import Rule, Severity
from verl_safe_launch.inputs import verl_release
from verl_safe_launch.rules.kit import Draft, check, kv

FILE_KEYS = ("data.train_files", "data.val_files")
PROMPT_KEY = "data.prompt_key"


def _paths(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [str(v) for v in value if v is not None]
    return []


def _remote(path: str) -> bool:
    return "://" in path


def _by_default(view: ConfigView, key: str) -> bool:
    prov = view.prov(key)
    return prov is not None and str(prov.source.layer) == "verl"


SHOWN_PATHS = 3
"""Paths of a list named in one message; the rest are counted (a list of 20,000 shards is one finding)."""


def _kv(view: ConfigView, key: str) -> str:
    """``key=value``, a long list of paths shortened to its first few."""
    value = view.get(key)
    if isinstance(value, list | tuple) and len(value) > SHOWN_PATHS:
        head = ", ".join(str(v) for v in value[:SHOWN_PATHS])
        return f"{key}=[{head}, ... ({len(value):,} paths)]"
    return kv(view, key)


def _listed(paths: list[str]) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:SHOWN_PATHS])
    return shown + (f" and {len(paths) - SHOWN_PATHS:,} more" if len(paths) > SHOWN_PATHS else "")


@check("data-files-missing", "local data files exist")
def files_missing(ctx: RuleContext) -> list[Draft]:
    """A local train/val file that is not there fails verl only when it loads the dataset, after the models."""
    out: list[Draft] = []
    for key in FILE_KEYS:
        missing = [
            p for p in _paths(ctx.view.get(key)) if not _remote(p) and not Path(p).expanduser().exists()
        ]
        if not missing:
            continue
        placeholder = _by_default(ctx.view, key)
        what = "verl's placeholder path" if placeholder else "a local path"
        here = ctx.hardware.on_this_machine
        where = "" if here else " on this machine (cannot verify where the job runs)"
        are = f"is {what} and does not exist" if len(missing) == 1 else "are local paths that do not exist"
        msg = f"{_kv(ctx.view, key)}: {_listed(missing)} {are}{where}; "
        msg += f"{verl_release().name} fails when it loads the dataset"
        fix = f"{key}=/path/to/your/{'train' if 'train' in key else 'test'}.parquet"
        # An error only where the GPUs were detected (the run happens here); elsewhere the file may exist where
        # the job runs. verl's own placeholder is a warning: set it, but it is not a choice you made.
        severity = None if here and not placeholder else Severity.WARNING
        out.append(Draft((key,), msg, (), severity, fix))
    return out


@check("data-files-remote", "remote data files are not checked here", Severity.INFO)
def files_remote(ctx: RuleContext) -> list[Draft]:
    """A remote URI (hdfs://, s3://, ...) is verl's to fetch: named, not checked."""
    out: list[Draft] = []
    for key in FILE_KEYS:
        remote = [p for p in _paths(ctx.view.get(key)) if _remote(p)]
        if remote:
            out.append(Draft((key,), f"{key}: {', '.join(remote)} is remote; not checked before the launch"))
    return out


@functools.lru_cache(maxsize=64)
def _schema(path: str, stamp: tuple[float, int]) -> tuple[str, ...] | str | None:
    """Column names of a parquet file (schema only), the reason when it cannot be read, None without pyarrow."""
    del stamp  # part of the cache key: a rewritten file is read again
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return tuple(pq.read_schema(path).names)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _columns(path: str, stamp: tuple[float, int]) -> tuple[str, ...] | None:
    found = _schema(path, stamp)
    return found if isinstance(found, tuple) else None


def _unreadable(local: Path) -> str | None:
    """Why verl cannot read a local data file that exists: not a regular file, or a parquet file that is not one."""
    try:
        mode = local.stat().st_mode
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISDIR(mode):
        return None  # a directory of parquet files is verl's to list
    if not stat.S_ISREG(mode):
        return f"it is {kind_of(mode)}, not a regular file"
    if local.suffix != ".parquet":
        return None
    st = local.stat()
    found = _schema(str(local), (st.st_mtime, st.st_size))
    return f"it is not a readable parquet file ({found})" if isinstance(found, str) else None


@check("data-file-unreadable", "local data files are regular, readable parquet files")
def file_unreadable(ctx: RuleContext) -> list[Draft]:
    """A named pipe, a device or a corrupt parquet file fails verl when it loads the dataset."""
    out: list[Draft] = []
    for key in FILE_KEYS:
        for path in _paths(ctx.view.get(key)):
            local = Path(path).expanduser()
            if _remote(path) or not local.exists():
                continue
            reason = _unreadable(local)
            if reason is not None:
                here = ctx.hardware.on_this_machine
                where = "" if here else " (on this machine; the job may see another file)"
                msg = f"{_kv(ctx.view, key)}: verl cannot load '{path}'{where}: {reason}"
                fix = f"{key}=/path/to/your/{'train' if 'train' in key else 'test'}.parquet"
                out.append(Draft((key,), msg, (), None if here else Severity.WARNING, fix))
    return out


@check("data-prompt-key-missing", "the parquet files have data.prompt_key")
def prompt_key_missing(ctx: RuleContext) -> list[Draft]:
    """verl reads each row's ``data.prompt_key`` column; a file without it fails at the first batch."""
    prompt = ctx.view.get(PROMPT_KEY)
    if not isinstance(prompt, str):
        return []
    out: list[Draft] = []
    for key in FILE_KEYS:
        for path in _paths(ctx.view.get(key)):
            local = Path(path).expanduser()
            if _remote(path) or local.suffix != ".parquet" or not local.is_file():
                continue
            stat = local.stat()
            columns = _columns(str(local), (stat.st_mtime, stat.st_size))
            if columns is None or prompt in columns:
                continue
            msg = (
                f"{kv(ctx.view, PROMPT_KEY)} is not a column of {key} '{path}' (columns: {', '.join(columns)}); "
                f"{verl_release().name} fails when it reads the first batch"
            )
            fixes = tuple(f"{PROMPT_KEY}={c}" for c in columns if "prompt" in c.lower()) or (
                f"set {PROMPT_KEY} to one of the columns",
            )
            out.append(Draft((PROMPT_KEY, key), msg, (), None, "; or ".join(fixes)))
    return out


RULES: tuple[Rule[RuleContext], ...] = (files_missing, files_remote, file_unreadable, prompt_key_missing)

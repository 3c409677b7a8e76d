"""Safe file IO: read only regular files within a size limit; write through a private temp file, then rename."""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from verl_safe_launch.errors import InputError, UsageError
from verl_safe_launch.secret import redact

MAX_INPUT_BYTES = 1024 * 1024
"""The largest input file read by default (a YAML layer): 1 MiB. Launch scripts have 256 KiB, config.json 4 MiB."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words ("a named pipe (FIFO)"); "a regular file" for a plain file."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file")


def read_input(
    path: Path | str,
    *,
    what: str = "file",
    where: str | None = None,
    missing_fix: str = "check the path",
    limit: int = MAX_INPUT_BYTES,
    follow: bool = True,
) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; raise InputError (exit 2) at once otherwise.

    The file is opened non-blocking, so a named pipe or a device is refused instead of waiting forever; with
    ``follow=False`` a symbolic link is refused too.
    """
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}", where=where, fix=missing_fix) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        if isinstance(exc, OSError) and exc.errno == errno.ELOOP and not follow:
            raise InputError(f"{path} is a symbolic link, not a regular file", where=where) from None
        raise InputError(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", where=where
        ) from None
    _only_regular(fd, path, what, where)
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise InputError(f"cannot read {path}: {exc.strerror or exc}", where=where) from None
    if len(data) > limit:
        raise InputError(
            f"{path} is larger than the {limit // 1024} KiB limit for a {what}",
            where=where,
            fix=f"pass a {what} under {limit // 1024} KiB",
        )
    return data


def _only_regular(fd: int, path: Path, what: str, where: str | None) -> None:
    """Close ``fd`` and raise InputError unless it is a regular file (a FIFO, a device, a socket, a directory)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InputError(
            f"{path} is {kind_of(mode)}, not a regular file", where=where, fix=f"pass a {what} saved on disk"
        )


def open_regular(path: Path | str, *, what: str = "file", where: str | None = None) -> BinaryIO:
    """A regular file opened for streaming (any size); a FIFO, a device (``/dev/zero`` behind a link), a socket
    or a directory is an InputError at once, never waited on or read forever."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:
        raise InputError(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", where=where
        ) from None
    _only_regular(fd, path, what, where)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_text_input(
    path: Path | str,
    *,
    what: str = "file",
    where: str | None = None,
    missing_fix: str = "check the path",
    limit: int = MAX_INPUT_BYTES,
) -> str:
    """``read_input`` decoded as UTF-8; a file that is not UTF-8 text is an InputError."""
    data = read_input(path, what=what, where=where, missing_fix=missing_fix, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path} is not a text file (byte {exc.start} is not UTF-8)", where=where, fix=f"pass a {what}"
        ) from None


def shown_path(path: Path | str) -> str:
    """A path as text even when its name is not valid in the locale's encoding (undecodable bytes as ``\\xff``)."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def check_text_name(path: Path | str, *, where: str = "-o") -> None:
    """A path written to (or into a written file) must be text: bytes the locale cannot decode are refused;
    so is a path the kernel would refuse for its length (``check_path_length``)."""
    check_text(path, where=where)
    check_path_length(path, where=where)


def check_text(path: Path | str, *, where: str = "-o") -> None:
    """Text written into a file must be valid in the locale's encoding: undecodable bytes are refused."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"{shown_path(path)}: the name is not valid text in this locale's encoding "
            f"({sys.getfilesystemencoding()})",
            where=where,
            fix="use a name of ASCII letters, digits, '.', '-' and '_', or run under a UTF-8 locale (LANG=C.UTF-8)",
        ) from None


NAME_MAX = 255
"""The longest file name (one path component) in bytes, on Linux's file systems."""
PATH_MAX = 4096
"""The longest path in bytes the kernel takes, its final NUL included."""


def check_path_length(path: Path | str, *, where: str) -> None:
    """Refuse a path with a component over NAME_MAX bytes or a whole over PATH_MAX (the kernel's ENAMETOOLONG)."""
    raw = os.fsencode(str(path))
    if len(raw) >= PATH_MAX:
        raise UsageError(
            f"a path of {len(raw):,} bytes is over the {PATH_MAX - 1:,}-byte limit of a path",
            where=where,
            fix="choose a shorter path",
        )
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        name = longest.decode("utf-8", "backslashreplace")
        raise UsageError(
            f"the name {name[:24]}...{name[-8:]} ({len(longest):,} bytes) is over the {NAME_MAX}-byte limit of "
            "one file name",
            where=where,
            fix="choose a shorter name",
        )


def output_path(text: str) -> Path:
    """An argparse ``type`` for a path to write: refused at once when it could never be created."""
    check_text_name(text, where="command line")
    return Path(text)


def check_target(path: Path, *, force: bool, inputs: Iterable[Path | str] = (), where: str = "-o") -> None:
    """Refuse to write ``path`` when it is an input of this command, not a regular file, or exists without --force."""
    check_text_name(path, where=where)
    for source in inputs:
        if _same_file(path, Path(source)):
            raise UsageError(
                f"{path} is an input of this command; it is never overwritten, even with --force",
                where=where,
                fix="write to another path",
            )
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}", where=where) from None
    if stat.S_ISLNK(mode):
        raise UsageError(
            f"{path} is a symbolic link; it is not followed or replaced",
            where=where,
            fix=f"write to the file it points to: {shlex.quote(os.path.realpath(path))}",
        )
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"{path} is {kind_of(mode)}; only a regular file is replaced",
            where=where,
            fix="write to another path",
        )
    if not force:
        raise UsageError(
            f"{path} already exists", where=where, fix="pass --force to overwrite it, or choose another path"
        )


def write_files(
    files: Mapping[Path, tuple[str, int]],
    *,
    force: bool,
    inputs: Iterable[Path | str] = (),
    where: str = "-o",
    keep_mode: bool = True,
) -> None:
    """Write every file or none: each is checked (``check_target``), written to a private temp file beside it
    (``mkstemp``: unpredictable name, never follows a link), then all are renamed into place.

    ``files`` maps each path to its text and mode; a replaced file keeps its own mode when ``keep_mode``.
    """
    sources = list(inputs)
    for path in files:
        check_target(path, force=force, inputs=sources, where=where)
    new = {path for path in files if not os.path.lexists(path)}
    staged: list[tuple[str, Path]] = []
    renamed: list[Path] = []
    try:
        for path, (text, mode) in files.items():
            staged.append((_stage(path, text, mode, where, keep_mode), path))
    except BaseException:
        _unlink(tmp for tmp, _ in staged)
        raise
    with _signals_deferred():  # Ctrl-C or SIGTERM arrives after the last rename, not between two
        try:
            for tmp, path in staged:
                _rename(tmp, path, where)
                renamed.append(path)
        except BaseException:  # a rename refused: the new files already in place go again
            _unlink(path if path in renamed and path in new else tmp for tmp, path in staged)
            raise


def _unlink(paths: Iterable[Path | str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for a few system calls and deliver them on leaving. Python runs signal handlers
    in the main thread only: elsewhere nothing can interrupt the block, and it runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    saved = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not None:  # None: a handler from outside Python, kept as it is
            saved[signum] = signal.signal(signum, lambda number, frame: held.append(number))
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for number in dict.fromkeys(held):
            signal.raise_signal(number)


def write_atomic(
    path: Path,
    text: str,
    *,
    force: bool,
    inputs: Iterable[Path | str] = (),
    mode: int = 0o644,
    where: str = "-o",
    keep_mode: bool = True,
) -> None:
    """Write one file through a private temp file beside it (see ``write_files``)."""
    write_files({path: (text, mode)}, force=force, inputs=inputs, where=where, keep_mode=keep_mode)


def make_directory(base: Path, *, where: str = "--run-dir", mode: int = 0o777) -> Path:
    """Create a new directory ``base`` (its parents as needed) atomically; on a collision, ``base_1``, ``base_2`` ...

    Two processes never get the same directory: ``mkdir`` itself decides who created it.
    """
    check_text_name(base, where=where)
    _mkdirs(base.parent, where)
    for n in range(10_000):
        candidate = base if n == 0 else base.with_name(f"{base.name}_{n}")
        try:
            candidate.mkdir(mode)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UsageError(f"cannot create {candidate}: {exc.strerror or exc}", where=where) from None
        return candidate
    raise UsageError(
        f"cannot find a free name next to {base}", where=where, fix="clean up old run directories"
    )


def ensure_directory(path: Path, *, where: str = "--run-dir", mode: int = 0o777) -> None:
    """Create ``path`` and its parents when missing; a path that is not a directory is a UsageError."""
    _mkdirs(path, where, mode)


def _mkdirs(path: Path, where: str, mode: int = 0o777) -> None:
    check_text_name(path, where=where)
    try:
        path.mkdir(mode, parents=True, exist_ok=True)  # the mode (less the umask) of the last one only
    except FileExistsError:
        raise UsageError(
            f"{path} exists and is not a directory", where=where, fix="choose another path"
        ) from None
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {exc.strerror or exc}", where=where) from None


def _stage(path: Path, text: str, mode: int, where: str, keep_mode: bool) -> str:
    directory = path.parent if str(path.parent) else Path(".")
    old: int | None = None
    if keep_mode:
        with contextlib.suppress(FileNotFoundError):
            old = os.stat(path).st_mode & 0o7777
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise UsageError(
            f"cannot write {path}: {exc.strerror or exc}",
            where=where,
            fix="choose a directory you can write to",
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(redact(text))  # no secret's value reaches a file: ${oc.env:NAME} in its place
        os.chmod(tmp, mode if old is None else old)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, UnicodeEncodeError):
            raise UsageError(
                f"cannot write {path}: its text names a file whose name is not valid UTF-8",
                where=where,
                fix="rename the inputs with ASCII or UTF-8 names, or run under a UTF-8 locale (LANG=C.UTF-8)",
            ) from None
        if isinstance(exc, OSError):
            raise UsageError(f"cannot write {path}: {exc.strerror or exc}", where=where) from None
        raise
    return tmp


def _rename(tmp: str, path: Path, where: str) -> None:
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}", where=where) from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)

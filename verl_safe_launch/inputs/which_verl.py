"""Which verl a project uses: ``--verl``, a copy vendored beside or above its script, its pin, the installed one."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.inputs.knowledge import cache_root, read_version
from verl_safe_launch.inputs.pins import Pin, project_dirs, project_pin
from verl_safe_launch.inputs.release import TESTED
from verl_safe_launch.inputs.verl_paths import installed_verl, package_in, user_verl

OFFLINE_ENV = "VSL_OFFLINE"
"""Set to 1: a pinned release that is not in the cache is never fetched; the command that fetches it is named."""
FETCH_TIMEOUT_S = 600.0
CHECKOUTS = ("verl", "src")
"""Where a project keeps a verl checkout it installs from (``verl/verl``, ``src/verl``), besides ``verl/`` itself."""


@dataclass(frozen=True)
class VerlChoice:
    """The verl a project uses: its package directory, its release, how it was found, whether it is tested.

    ``warning`` names what was passed over on the way and why (a vendored copy that cannot be read, a pinned
    release that could not be fetched); the checks then fall back to the next in the order.
    """

    path: Path
    release: str | None
    how: str
    tested: bool
    warning: str | None = None

    @property
    def installed(self) -> bool:
        """True for the verl this Python imports anyway (no ``--verl``, no vendored or pinned copy)."""
        return self.how.startswith("installed")


def project_verl(where: Path | None = None, exports: Sequence[tuple[str, str]] = ()) -> VerlChoice:
    """The verl the project of ``where`` (a launch script or config file, or a directory; default the working
    directory) uses.

    In this order: the verl the user named (``--verl``, ``VSL_VERL``); a copy the script imports (a literal
    ``cd DIR`` it makes, a ``PYTHONPATH`` it exports, relative entries read from its directory) or one vendored
    beside it or in a directory above it, up to the project's root; the release the project pins (a
    ``requirements*.txt``, ``pyproject.toml``, ``setup.py`` or ``setup.cfg`` there: ``verl==X``), read from a
    ``pip --target`` copy in the knowledge cache, fetched on first use; the installed verl.
    """
    user = user_verl()
    if user is not None:
        return _choice(*user)
    start = where if where is not None else Path.cwd()
    script = start if start.is_file() else None
    base = start.parent if script is not None else start
    dirs = project_dirs(base)
    passed: list[str] = []
    found = _vendored(script, base, dirs, exports, passed) or _pinned(dirs, passed) or installed_verl()
    return _choice(*found, warning="; ".join(passed) or None)


@dataclass(frozen=True)
class ProjectVerl:
    """The verl a project itself names: its vendored copy (``package``), or the release it pins (``pinned``)."""

    package: Path | None
    pinned: str | None
    how: str


def own_verl(script: Path, exports: Sequence[tuple[str, str]] = ()) -> ProjectVerl | None:
    """The verl the project of ``script`` names, found as ``project_verl`` finds it but never fetched and never
    the installed one or the user's: a copy it imports or vendors, else its pin. None: the project names none."""
    base = script.parent if script.is_file() else script
    dirs = project_dirs(base)
    found = _vendored(script if script.is_file() else None, base, dirs, exports, [])
    if found is not None:
        return ProjectVerl(found[0], None, found[1])
    pin = project_pin(dirs)
    return (
        ProjectVerl(None, pin.version, f"{pin.where} pins verl=={pin.version}") if pin is not None else None
    )


def _choice(package: Path, how: str, warning: str | None = None) -> VerlChoice:
    release = read_version(package)
    return VerlChoice(package, release, how, release in TESTED, warning)


def _vendored(
    script: Path | None, base: Path, dirs: list[Path], exports: Sequence[tuple[str, str]], passed: list[str]
) -> tuple[Path, str] | None:
    """A copy the script imports or the project vendors; copies that cannot be read are added to ``passed``."""
    name = script.name if script is not None else "the working directory"
    candidates: list[tuple[Path, str]] = []
    moved = _cd_target(script) if script is not None and script.suffix not in (".yaml", ".yml") else None
    if moved is not None:
        candidates.append((base / moved, f"vendored in {moved}, where {name} cd's"))
    for key, value in exports:
        if key == "PYTHONPATH":
            candidates += [(base / entry, f"PYTHONPATH set by {name}") for entry in value.split(":") if entry]
    for level, directory in enumerate(dirs):
        place = _place(level, name, script is None)
        for holder in (directory, *(directory / sub for sub in CHECKOUTS)):
            candidates.append((holder, f"vendored {place}"))
    for directory, how in candidates:
        why = unreadable(directory / "verl")
        package = package_in(directory) if why is None else None
        if package is not None:
            return package, how
        if why:
            passed.append(
                f"the verl vendored at {directory / 'verl'} cannot be read ({why}), so it is not used"
            )
    return None


def _place(level: int, name: str, directory: bool) -> str:
    """``beside run.sh``, ``in the working directory``, ``2 directories above run.sh``."""
    if level == 0:
        return f"in {name}" if directory else f"beside {name}"
    return f"{level} director{'y' if level == 1 else 'ies'} above {name}"


def unreadable(package: Path) -> str | None:
    """Why a ``verl`` directory cannot be read as verl ("" when it is no verl copy at all, None when it can)."""
    try:
        if not package.is_dir():
            return ""
        if not (package / "__init__.py").is_file():
            return "it has no __init__.py" if (package / "trainer").is_dir() else ""
        config = package / "trainer" / "config" / "ppo_trainer.yaml"
        if not config.is_file():
            return "it has no trainer/config/ppo_trainer.yaml"
        config.read_bytes()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _cd_target(script: Path) -> str | None:
    """The directory of the last top-level ``cd DIR`` line with a literal argument (None: none, or not literal)."""
    target = None
    try:
        lines = script.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(words) == 2 and words[0] == "cd" and "$" not in words[1] and "`" not in words[1]:
            target = words[1]
    return target


def _pinned(dirs: list[Path], passed: list[str]) -> tuple[Path, str] | None:
    """The release the project pins: the installed verl when it is that release, else a copy in the cache."""
    pin = project_pin(dirs)
    if pin is None:
        return None
    installed, _ = installed_verl()
    if read_version(installed) == pin.version:
        return installed, f"installed, the release {pin.where} pins"
    target = pinned_copy_dir(pin.version)
    how = f"verl=={pin.version} pinned in {pin.where}, a pip --target copy"
    why = None if package_in(target) is not None else _fetch(pin, target)
    package = package_in(target)
    if why is None and package is not None:
        return package, how
    passed.append(
        f"{pin.where} pins verl=={pin.version}, which is not installed here and was not fetched ({why}); "
        f"to check against it: {fetch_command(pin.version)}"
    )
    return None


def pinned_copy_dir(version: str) -> Path:
    """Where a pinned release is installed for reading: ``<cache>/releases/<version>``."""
    return cache_root() / "releases" / version


def fetch_command(version: str) -> str:
    """The command that installs a release where the checks look for it."""
    target = shlex.quote(str(pinned_copy_dir(version)))
    return f"pip install --no-deps --target {target} {shlex.quote(f'verl=={version}')}"


def _fetch(pin: Pin, target: Path) -> str | None:
    """Install ``verl==X`` (no dependencies: it is read, never imported) into ``target``; None, or why not."""
    if os.environ.get(OFFLINE_ENV) == "1":
        return f"{OFFLINE_ENV}=1"
    print(
        f"fetching verl=={pin.version} ({pin.where} pins it) for reading: {fetch_command(pin.version)}",
        file=sys.stderr,
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{pin.version}-", dir=target.parent))
    except OSError as exc:
        return f"the cache cannot be written: {exc.strerror or exc}"
    try:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging)]
        done = subprocess.run(
            [*cmd, f"verl=={pin.version}"],
            capture_output=True,
            text=True,
            timeout=FETCH_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return f"pip failed: {lines[-1].strip() if lines else f'exit {done.returncode}'}"
        if package_in(staging) is None:
            return "pip installed no verl package"
        try:
            staging.rename(target)
        except OSError:
            if package_in(target) is None:  # another process put it there first: use theirs
                raise
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"pip could not run: {exc}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)

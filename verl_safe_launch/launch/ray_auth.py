"""Ray's token authentication: which mode the driver and every Ray process use, and where the token comes from."""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.errors import EXIT_PREFLIGHT, InputError, VslError
from verl_safe_launch.files import read_input

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
NEW_TOKEN = "a token made for this run (in the environment of Ray's processes only, written nowhere)"
TOKEN_HELP = f"{TOKEN_ENV}, {TOKEN_PATH_ENV} or ~/.ray/auth_token"


class AuthMismatch(VslError):
    """Token authentication is asked for an existing cluster, but this process has no token to present."""

    exit_code = EXIT_PREFLIGHT


@dataclass(frozen=True)
class RayAuth:
    """One RAY_AUTH_MODE for the driver and everything it starts, what decided it, and the token's source."""

    mode: str
    why: str
    token: str = ""

    @property
    def new_token(self) -> bool:
        """True when the launcher makes the token (a new local Ray with no token anywhere)."""
        return self.token == NEW_TOKEN

    def describe(self) -> str:
        """One line for the plan: the mode, why, and where the token comes from."""
        if self.mode != "token":
            return f"{self.mode} ({self.why}): no token; anyone who can reach Ray's ports can run code on it"
        return f"token ({self.why}), {self.token}"

    def to_json(self) -> dict[str, str]:
        """The ``ray_auth`` object of ``run --format json`` (never the token itself)."""
        return {"mode": self.mode, "why": self.why, "token_source": self.token}


def token_source(env: Mapping[str, str]) -> str | None:
    """Where Ray would read a token from, in Ray's order; None when there is none."""
    if env.get(TOKEN_ENV, "").strip():
        return TOKEN_ENV
    if env.get(TOKEN_PATH_ENV):  # Ray reads only this file when the variable is set
        path = Path(env[TOKEN_PATH_ENV])
        return f"{TOKEN_PATH_ENV} ({path})" if _has_text(path) else None
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return "~/.ray/auth_token" if _has_text(home / ".ray" / "auth_token") else None


def _has_text(path: Path) -> bool:
    """A token file with text in it: a regular file of at most 64 KiB (a FIFO is never waited on)."""
    try:
        return bool(read_input(path, what="token file", limit=64 * 1024).strip())
    except InputError:
        return False


def ray_auth(address: str | None, env: Mapping[str, str]) -> RayAuth:
    """The auth mode for a new local Ray (``address`` None) or for attaching to ``address``.

    An explicit RAY_AUTH_MODE wins. A new local Ray uses token auth, Ray's own default, with the user's token or,
    when there is none, one made for this run. Attaching, token auth is used exactly when a token is available, so
    the cluster's own mode decides; asking for token auth without any token is refused before Ray is touched.
    """
    explicit = env.get(MODE_ENV, "").strip().lower()
    source = token_source(env)
    if explicit:
        mode, why = explicit, f"{MODE_ENV}={explicit}"
    elif address is None:
        mode, why = "token", "Ray's default for a new local Ray"
    else:
        mode, why = ("token", "a token is available") if source else ("disabled", "no token available")
    if mode != "token":
        return RayAuth(mode, why)
    if source:
        return RayAuth(mode, why, f"token from {source}")
    if address is None:
        return RayAuth(mode, why, NEW_TOKEN)
    raise AuthMismatch(
        f"{MODE_ENV}=token asks for token authentication with the Ray cluster at {address}, "
        "but this process has no token",
        where=f"{MODE_ENV} in the environment; no {TOKEN_HELP}",
        fix=f"export the cluster's token as {TOKEN_ENV}=... (or {TOKEN_PATH_ENV}=FILE), "
        f"or {MODE_ENV}=disabled if the cluster was started with it",
    )


def refused(exc: BaseException) -> bool:
    """True when Ray's error (or anything it was raised from) says the cluster refused this process's token."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def auth_env(auth: RayAuth) -> Iterator[None]:
    """The auth mode (and a new token if needed) in this process's environment while Ray runs; restored after.

    Ray's processes inherit the driver's environment, so a new token reaches the GCS, the raylet and every worker
    without being written anywhere. Ray caches the mode and token when imported: both caches are refreshed.
    """
    saved = {name: os.environ.get(name) for name in (MODE_ENV, TOKEN_ENV)}
    os.environ[MODE_ENV] = auth.mode
    if auth.new_token:
        os.environ[TOKEN_ENV] = secrets.token_hex(32)
    _refresh_ray()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _refresh_ray()


def _refresh_ray() -> None:
    """Make this process's Ray read RAY_AUTH_MODE and the token again (as Ray does when it enables token auth)."""
    with contextlib.suppress(ImportError, AttributeError):
        raylet = importlib.import_module("ray._raylet")
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()

"""Secrets: which variables hold one, and their values kept out of every file written and every line printed.

A variable is a secret by its name: one holding ``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD``, ``PASSWD``,
``CREDENTIAL`` or ``PRIVATE`` (``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``...), except a name that
ends in ``_PATH``, ``_FILE`` or ``_DIR`` (where a secret is kept, not the secret) and ``TOKENIZERS_PARALLELISM``.
The values of such variables in this process's environment, and those a launch script assigns (registered when
the script is read), are replaced by ``${oc.env:NAME}`` wherever they would be written or printed: the
interpolation that reads the value back from the environment, so a YAML file or a command line keeps working
where the variable is set, and records the secret by its name only. A value shorter than ``MIN_LENGTH`` or made
of digits only is not looked for: it would match ordinary numbers and words. Nor is a placeholder a script ships
in place of its key (``TO_BE_FILLED``, ``<your-key>``, ``YOUR_WANDB_KEY``): capitals and underscores only, or
angle brackets, or "your"/"xxxx"/"changeme"; a script often uses the same placeholder for other values.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Mapping

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE")
NOT_SECRETS = frozenset({"TOKENIZERS_PARALLELISM"})
"""Names holding a secret word that are settings everyone shares."""
LOCATION_SUFFIXES = ("_PATH", "_FILE", "_DIR")
MIN_LENGTH = 6
_PLACEHOLDER = re.compile(r"[A-Z_\-]+|<[^<>]*>|(?i:.*(your|xxxx|changeme|placeholder).*)")

_REGISTERED: dict[str, str] = {}
"""Secret values met in inputs (a script's ``export HF_TOKEN=...``), value → name."""


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a variable of this name holds a secret (see the module's docstring)."""
    upper = name.upper()
    if upper in NOT_SECRETS or upper.endswith(LOCATION_SUFFIXES):
        return False
    return any(word in upper for word in SECRET_WORDS)


def worth_hiding(value: str) -> bool:
    """A value long and specific enough to look for in text."""
    return len(value) >= MIN_LENGTH and not value.isdigit() and _PLACEHOLDER.fullmatch(value) is None


def register(name: str, value: str) -> None:
    """Remember a secret met in an input, so that it is hidden like the environment's."""
    if is_secret_name(name) and worth_hiding(value):
        _REGISTERED[value] = name


def forget() -> None:
    """Drop the registered secrets (a new command starts)."""
    _REGISTERED.clear()


def secret_names(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` that hold secrets, sorted."""
    return sorted(name for name in env if is_secret_name(name))


def redact(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` with every secret value replaced by ``${oc.env:NAME}``."""
    values = _values(os.environ if env is None else env)
    if not values:
        return text
    pattern, names = _pattern(tuple(sorted(values.items())))
    return pattern.sub(lambda m: "${oc.env:" + names[m.group()] + "}", text)


def _values(env: Mapping[str, str]) -> dict[str, str]:
    found = dict(_REGISTERED)
    for name, value in env.items():
        if is_secret_name(name) and worth_hiding(value):
            found[value] = name
    return found


@functools.lru_cache(maxsize=8)
def _pattern(items: tuple[tuple[str, str], ...]) -> tuple[re.Pattern[str], dict[str, str]]:
    """One regular expression for every secret and the spellings a file gives it (JSON's escapes)."""
    names: dict[str, str] = {}
    for value, name in items:
        for spelling in _spellings(value):
            names.setdefault(spelling, name)
    ordered = sorted(names, key=len, reverse=True)  # the longest first: a secret inside another is not cut
    return re.compile("|".join(re.escape(s) for s in ordered)), names


def _spellings(value: str) -> Iterable[str]:
    yield value
    yield json.dumps(value)[1:-1]  # JSON escapes quotes, backslashes and anything not ASCII
    yield value.replace("'", "'\"'\"'")  # inside a shell's single quotes


__all__ = [
    "MIN_LENGTH",
    "SECRET_WORDS",
    "forget",
    "is_secret_name",
    "redact",
    "register",
    "secret_names",
    "worth_hiding",
]

"""The exception hierarchy: user errors carry what went wrong, where it came from and how to fix it."""

from __future__ import annotations

EXIT_OK = 0
EXIT_PREFLIGHT = 1
EXIT_USAGE = 2
EXIT_LAUNCH = 3
EXIT_INTERNAL = 4
"""An unexpected exception: a bug in verl-safe-launch, never a pre-flight verdict."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as shells report it."""


class VslError(Exception):
    """Base of every error verl-safe-launch reports to the user without a traceback."""

    exit_code = EXIT_USAGE

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.where = where
        self.fix = fix

    def render(self) -> str:
        """The compact message: what, then where it came from, then how to fix it."""
        lines = [f"error: {self.what}"]
        if self.where:
            lines.append(f"  where: {self.where}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)


class UsageError(VslError):
    """Bad command line: unknown verb or option, invalid override syntax, unknown key."""


class InputError(VslError):
    """A file the user named is missing, unreadable or malformed."""


class ConfigError(VslError):
    """The configuration cannot be composed (for example an unknown preset or a Hydra composition error)."""


class LaunchError(VslError):
    """The launch started and failed (Ray or verl error, out of memory)."""

    exit_code = EXIT_LAUNCH


class ManyErrors(UsageError):
    """Several user errors found at once (for example every override Hydra refused); rendered together."""

    def __init__(self, errors: list[VslError]) -> None:
        super().__init__(f"{len(errors)} problems", None, None)
        self.errors = tuple(errors)
        self.exit_code = max(e.exit_code for e in errors)

    def render(self) -> str:
        """Each error's compact message, one after the other."""
        return "\n".join(e.render() for e in self.errors)


def collect(errors: list[VslError]) -> VslError:
    """One error for one problem, a ``ManyErrors`` for several."""
    return errors[0] if len(errors) == 1 else ManyErrors(errors)

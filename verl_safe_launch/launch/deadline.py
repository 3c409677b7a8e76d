"""Blocking calls that have no timeout of their own (``ray.init``, Ray's job client) run with a deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ABANDONED: list[threading.Thread] = []
"""Threads left running at a deadline. One still inside Ray's native client can crash the interpreter's teardown
(a segmentation fault after the error was reported), so a process that has one ends with ``os._exit``."""


def within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` in a daemon thread: its result, its exception re-raised, or TimeoutError at the deadline.

    At the deadline the thread is abandoned; being a daemon, it never holds up the process's exit. Import what
    ``fn`` needs before calling: an abandoned thread that is still importing holds the import lock.
    """
    box: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:
            box.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not box:
        ABANDONED.append(thread)
        raise TimeoutError(f"no answer within {seconds:g} s")
    ok, value = box[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]

"""The last guard of stdout and stderr: nothing leaves this process hidden from the reader, or secret.

Every verb's text goes through ``escape`` where it shows user text; the guard wraps the streams for the whole
command, so whatever reaches them (a library's message, a path, a cluster's answer printed by some other route)
still has its format and bidirectional characters shown as escapes, and every secret's value replaced by
``${oc.env:NAME}``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from verl_safe_launch.render.escape import escape_hidden
from verl_safe_launch.secret import redact


def shown(text: str) -> str:
    """``text`` as the guard lets it out: invisible characters escaped, secrets replaced."""
    return redact(escape_hidden(text))


class GuardedStream:
    """A text stream that writes ``shown(text)`` to the stream it wraps and is that stream otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(shown(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_output() -> Iterator[None]:
    """stdout and stderr guarded for the block (restored after it, whatever the block replaced them with)."""
    before = sys.stdout, sys.stderr
    sys.stdout = GuardedStream(before[0])
    sys.stderr = GuardedStream(before[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = before

"""HTTP answers from a cluster's job API are read up to a limit: an endless body cannot fill this process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

MAX_ANSWER_BYTES = 32 << 20
"""Bytes read of one HTTP answer (a node list of thousands of nodes is a few MiB)."""


class AnswerTooLong(Exception):
    """An HTTP answer went on past ``MAX_ANSWER_BYTES``; reading stopped there."""


@contextlib.contextmanager
def capped_answers(limit: int | None = None) -> Iterator[None]:
    """While inside, every answer read through ``requests`` (Ray's job and state clients use it) is read as a
    stream and refused past ``limit`` bytes (default ``MAX_ANSWER_BYTES``), instead of being read whole into memory."""
    import requests

    original = requests.Session.send

    def send(self: Any, request: Any, **kwargs: Any) -> Any:
        wanted_stream = kwargs.pop("stream", False)
        response = original(self, request, stream=True, **kwargs)
        if not wanted_stream:
            read_capped(response, MAX_ANSWER_BYTES if limit is None else limit)
        return response

    requests.Session.send = send  # type: ignore[method-assign]
    try:
        yield
    finally:
        requests.Session.send = original  # type: ignore[method-assign]


def read_capped(response: Any, limit: int) -> None:
    """Read a streamed ``requests`` answer into its ``content``, or raise AnswerTooLong past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    with contextlib.closing(response):
        for chunk in response.iter_content(1 << 16):
            size += len(chunk)
            if size > limit:
                raise AnswerTooLong(
                    f"the answer from {response.url} went on past {limit / (1 << 20):g} MiB; stopped reading"
                )
            chunks.append(chunk)
    response._content = b"".join(chunks)

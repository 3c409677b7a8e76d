"""submit reads a cluster's HTTP answers up to a limit: an endpoint streaming an endless body is refused early."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import EXAMPLES, CliResult

from verl_safe_launch.backends import answers

GRPO = str(EXAMPLES / "grpo_6gpu.yaml")


class Endless(BaseHTTPRequestHandler):
    """Answers every GET with a JSON body that never ends (or, under /short, a small one)."""

    sent = 0

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if self.path == "/short":
            self.wfile.write(b'{"ok": true}')
            return
        chunk = b"1," * 32768
        try:
            self.wfile.write(b"[")
            while True:
                self.wfile.write(chunk)
                type(self).sent += len(chunk)
        except OSError:
            return

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    httpd.daemon_threads = True
    Endless.sent = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_endless_answer_is_refused_past_the_limit(
    server: str, cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(answers, "MAX_ANSWER_BYTES", 1 << 20)
    result = cli("submit", "--address", server, "-c", GRPO, "hardware.gpu_memory_gb=80")
    assert result.code == 2
    assert f"error: cannot reach the job API at {server} (--address): the answer from {server}/" in result.err
    assert "went on past 1 MiB; stopped reading" in result.err
    assert Endless.sent < 64 << 20  # what the socket buffers held past the limit, not a deadline's worth


def test_a_short_answer_is_read_as_usual(server: str) -> None:
    import requests

    original = requests.Session.send
    with answers.capped_answers(1 << 20):
        assert requests.get(f"{server}/short", timeout=10).json() == {"ok": True}
        with pytest.raises(answers.AnswerTooLong):
            requests.get(f"{server}/endless", timeout=10)
    assert requests.Session.send is original

"""Memory of the streamed readers on large inputs: `audit --trace` output, `oom LOG`, and a `submit` answer.

Usage: python bench/hostile_streams.py [MEGABYTES]   (default 800)
Prints, for MEGABYTES of input each: the peak RSS of a process that traces a script printing MEGABYTES to stdout
and to stderr, the peak Python allocation and time of scanning a MEGABYTES log for its out-of-memory error, and
how much an endless HTTP answer was read before it was refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.00 GiB is free.\n"


def trace_rss(megabytes: int, folder: Path) -> str:
    script = folder / "loud.sh"
    size = megabytes * 1_000_000
    script.write_text(
        f"head -c {size} /dev/zero\nhead -c {size} /dev/zero >&2\npython3 -m verl.trainer.main_ppo a=1\n"
    )
    probe = (
        "import json, resource, sys, time\nfrom pathlib import Path\nfrom verl_safe_launch.shell import trace_script\n"
        "start = time.monotonic(); t = trace_script(Path(sys.argv[1]), timeout=600)\n"
        "print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic() - start, t.containment]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", probe, str(script)], env=env, capture_output=True, text=True, check=True
    )
    peak_kib, seconds, how = json.loads(out.stdout)
    return (
        f"--trace, {2 * megabytes} MB of output: peak RSS {peak_kib / 1024:.0f} MiB, {seconds:.1f} s ({how})"
    )


def oom_scan(megabytes: int, folder: Path) -> str:
    from verl_safe_launch.doctor import find_ooms

    log = folder / "big.log"
    line = b"(TaskRunner pid=1) step:1 - actor/loss:0.125 " * 20 + b"\n"
    block = line * (1_000_000 // len(line))
    with log.open("wb") as out:
        for _ in range(megabytes):
            out.write(block)
        out.write(OOM.encode())
    tracemalloc.start()
    start = time.monotonic()
    events = find_ooms(log)
    seconds = time.monotonic() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    log.unlink()
    return f"oom LOG, {megabytes} MB: {len(events)} error found, peak allocation {peak / 2**20:.2f} MiB, {seconds:.1f} s (traced)"


class Endless(BaseHTTPRequestHandler):
    sent = 0

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"1," * 32768)
                type(self).sent += 65536
        except OSError:
            return

    def log_message(self, format: str, *args: object) -> None:
        pass


def endless_answer() -> str:
    import requests

    from verl_safe_launch.backends import MAX_ANSWER_BYTES, AnswerTooLong, capped_answers

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    start = time.monotonic()
    try:
        with capped_answers():
            requests.get(f"http://127.0.0.1:{httpd.server_address[1]}/api/version", timeout=30)
    except AnswerTooLong:
        pass
    seconds = time.monotonic() - start
    httpd.shutdown()
    return f"submit, endless answer: refused after {MAX_ANSWER_BYTES >> 20} MiB ({Endless.sent / 2**20:.0f} MiB sent), {seconds:.1f} s"


def main() -> None:
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 800
    with tempfile.TemporaryDirectory(prefix="vsl-bench-") as tmp:
        print(trace_rss(megabytes // 2, Path(tmp)))
        print(oom_scan(megabytes, Path(tmp)))
    print(endless_answer())


if __name__ == "__main__":
    main()

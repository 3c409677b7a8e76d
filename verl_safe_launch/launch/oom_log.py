"""Find an out-of-memory error in a verl/Ray log: torch's CUDA message, the stage from the traceback, vLLM/SGLang."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.launch.hook_stages import STAGES

# torch >= 2.1: "CUDA out of memory. Tried to allocate 13.91 GiB. GPU 0 has a total capacity of 79.11 GiB of which
# 6.56 GiB is free. ... this process has 72.54 GiB memory in use."
TORCH_OOM = re.compile(
    r"CUDA out of memory\. Tried to allocate (?P<tried>[\d.]+) (?P<tu>[GMK]iB)\. GPU (?P<gpu>\d+) has a total "
    r"capac(?:i)?ty of (?P<total>[\d.]+) (?P<xu>[GMK]iB) of which (?P<free>[\d.]+) (?P<fu>[GMK]iB) is free\."
    r"(?:.*?[Tt]his process has (?P<used>[\d.]+) (?P<uu>[GMK]iB) memory in use)?"
)
# torch < 2.1: "Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity; 75.10 GiB already allocated; ...)"
TORCH_OOM_OLD = re.compile(
    r"CUDA out of memory\. Tried to allocate (?P<tried>[\d.]+) (?P<tu>[GMK]iB) \(GPU (?P<gpu>\d+); "
    r"(?P<total>[\d.]+) (?P<xu>[GMK]iB) total capacity; (?P<used>[\d.]+) (?P<uu>[GMK]iB) already allocated; "
    r"(?P<free>[\d.]+) (?P<fu>[GMK]iB) free"
)
# The inference engine could not place its KV cache (these stop the rollout server from starting).
ENGINE_ERRORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"No available memory for the cache blocks"), "vLLM found no memory left for the KV cache"),
    (
        re.compile(r"To serve at least one request with the models?'?s max seq len \((?P<len>\d+)\)"),
        "vLLM's KV cache is smaller than one sequence of max_model_len",
    ),
    (
        re.compile(r"Free memory on device .* is less than desired GPU memory utilization"),
        "vLLM found less free memory than gpu_memory_utilization asks for (the trainer still holds some)",
    ),
    (
        re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static"),
        "SGLang's KV-cache pool does not fit in its memory fraction",
    ),
    (re.compile(r"KV cache pool .*(?:too small|not enough)", re.I), "SGLang's KV-cache pool is too small"),
)
ROLLOUT = "rollout"
# Method names of verl's legacy fsdp_workers / dp_actor path that the hook table (V1 engine_workers) does not list.
LEGACY_METHODS = {
    "generate_sequences": ROLLOUT,
    "update_policy": "actor_update",
    "update_critic": "critic_update",
    "compute_values": "critic_values",
}
ROLLOUT_PATHS = ("vllm/", "sglang/", "EngineCore", "vllm_rollout", "sglang_rollout")
FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+, in (?P<func>\w+)')
RAY_TASK = re.compile(r"ray::[\w.]*?\.(?P<func>\w+)\(")
LOOKBACK = 400  # traceback lines searched above the error
FRAME_CHARS = 2048  # of each of those lines
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")
MAX_LINE = 64 << 10
"""Bytes of one log line matched at once; a longer line is read (and matched) in pieces of this size."""
MAX_EVENTS = 1000
"""Out-of-memory errors kept from the logs (the first is diagnosed; the rest are counted up to this)."""
UNITS = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / (1 << 20)}


@dataclass(frozen=True)
class OomEvent:
    """One out-of-memory error found in a log: where, what torch or the engine said, and the stage."""

    where: str
    line: str
    kind: str
    stage: str | None
    method: str | None
    tried_gib: float | None = None
    gpu: int | None = None
    total_gib: float | None = None
    free_gib: float | None = None
    in_use_gib: float | None = None
    detail: str = ""

    @property
    def needed_gib(self) -> float | None:
        """What the process needed at the failure, at least: memory in use plus the allocation that failed."""
        if self.in_use_gib is None or self.tried_gib is None:
            return None
        return self.in_use_gib + self.tried_gib


def method_stages() -> dict[str, str]:
    """Worker method name → hook stage: the hook table's methods, then the legacy worker's names."""
    table = {spec.method: spec.stage for spec in STAGES}
    return {**LEGACY_METHODS, **table}


def _gib(value: str | None, unit: str | None) -> float | None:
    return None if value is None else round(float(value) * UNITS.get(unit or "GiB", 1.0), 3)


def _torch_event(match: re.Match[str], where: str, line: str) -> OomEvent:
    g = match.groupdict()
    return OomEvent(
        where,
        line.strip(),
        "torch",
        None,
        None,
        tried_gib=_gib(g["tried"], g["tu"]),
        gpu=int(g["gpu"]),
        total_gib=_gib(g["total"], g["xu"]),
        free_gib=_gib(g["free"], g["fu"]),
        in_use_gib=_gib(g.get("used"), g.get("uu")),
    )


def _match(line: str, where: str) -> OomEvent | None:
    for pattern in (TORCH_OOM, TORCH_OOM_OLD):
        found = pattern.search(line)
        if found:
            return _torch_event(found, where, line)
    for pattern, detail in ENGINE_ERRORS:
        if pattern.search(line):
            return OomEvent(where, line.strip(), "kv-cache", ROLLOUT, None, detail=detail)
    return None


def stage_of(lines: Sequence[str]) -> tuple[str | None, str | None]:
    """The stage and method of a traceback: the outermost known worker method, or the rollout engine's code."""
    known = method_stages()
    names = sorted(known, key=len, reverse=True)
    in_engine = False
    for line in lines:
        found = FRAME.search(line) or RAY_TASK.search(line)
        if found is None:
            continue
        func = found.group("func")
        in_engine = in_engine or any(p in line for p in ROLLOUT_PATHS)
        method = next((name for name in names if func == name or func.endswith("_" + name)), None)
        if method is not None:
            return known[method], method
    return (ROLLOUT, None) if in_engine else (None, None)


def scan_lines(lines: Iterable[str], label: str) -> Iterator[OomEvent]:
    """Every out-of-memory error in a stream of log lines, with its stage from the lines above it.

    Only the last ``LOOKBACK`` lines are held: a log of any size is read in bounded memory.
    """
    window: deque[str] = deque(maxlen=LOOKBACK + 1)
    for index, line in enumerate(lines):
        window.append(line[:FRAME_CHARS])
        event = _match(line, f"{label}:{index + 1}")
        if event is None:
            continue
        if event.stage is None:
            stage, method = stage_of(list(window))
            event = OomEvent(**{**event.__dict__, "stage": stage, "method": method})
        yield event


def read_lines(file: Path) -> Iterator[str]:
    """A log's lines, decoded leniently, one at a time; a line longer than ``MAX_LINE`` bytes comes in pieces."""
    with file.open("rb") as stream:
        while line := stream.readline(MAX_LINE):
            yield line.decode("utf-8", "replace").rstrip("\r\n")


def log_files(path: Path) -> list[Path]:
    """The log itself, or the log-like files under a run directory (Ray's worker logs included), sorted."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)


def find_ooms(path: Path) -> list[OomEvent]:
    """The out-of-memory errors (the first ``MAX_EVENTS``) in a log file or the logs under a directory, in
    file order. Each file is streamed."""
    events: list[OomEvent] = []
    for file in log_files(path):
        label = str(file.relative_to(path)) if path.is_dir() else str(file)
        for event in scan_lines(read_lines(file), label):
            events.append(event)
            if len(events) == MAX_EVENTS:
                return events
    return events

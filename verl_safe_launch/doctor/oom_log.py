"""Find an out-of-memory error in a verl/Ray log: torch's CUDA message, the stage from the traceback, vLLM/SGLang."""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.files import open_regular
from verl_safe_launch.launch import STAGES

# torch >= 2.1: "CUDA out of memory. Tried to allocate 13.91 GiB. GPU 0 has a total capacity of 79.11 GiB of which
# 6.56 GiB is free. ... this process has 72.54 GiB memory in use." Inside a container torch may not find its own
# process among the driver's ("this process has 0 bytes", or no such sentence) and lists it as "Process N has".
SIZE = r"[\d.]+ (?:[GMK]iB|bytes)"
TORCH_OOM = re.compile(
    r"CUDA out of memory\. Tried to allocate (?P<tried>[\d.]+) (?P<tu>[GMK]iB|bytes)\. GPU (?P<gpu>\d+) has a "
    r"total capac(?:i)?ty of (?P<total>[\d.]+) (?P<xu>[GMK]iB) of which (?P<free>[\d.]+) (?P<fu>[GMK]iB|bytes) "
    r"is free\.(?:.*?this process has (?P<used>[\d.]+) (?P<uu>[GMK]iB|bytes) memory in use)?",
    re.I,
)
# "Of the allocated memory 60.49 GiB is allocated by PyTorch, [with 3.80 GiB allocated in private pools (e.g., CUDA
# Graphs),] and 6.77 GiB is reserved by PyTorch but unallocated."
TORCH_POOL = re.compile(
    rf"Of the allocated memory (?P<alloc>{SIZE}) is allocated by PyTorch,.*?(?P<spare>{SIZE}) is reserved by "
    r"PyTorch but unallocated",
    re.I,
)
FRAGMENTATION_MIN_GIB = 1.0
FRAGMENTATION_SHARE = 0.05
"""Reserved-but-unallocated memory above 1 GiB that, with the free memory, would have held the failed allocation,
or above 5% of the GPU, is the caching allocator's fragmentation (expandable segments reclaim it)."""
NON_PYTORCH_MAX_GIB = 6.0
"""What a process holds beyond PyTorch's pool, at most (CUDA context, NCCL and cuBLAS workspaces, a sleeping
inference engine's handles): the listed process holding PyTorch's pool plus no more than this is the one failing."""
# torch < 2.1: "Tried to allocate 2.00 GiB (GPU 0; 79.35 GiB total capacity; 75.10 GiB already allocated; ...)"
TORCH_OOM_OLD = re.compile(
    r"CUDA out of memory\. Tried to allocate (?P<tried>[\d.]+) (?P<tu>[GMK]iB) \(GPU (?P<gpu>\d+); "
    r"(?P<total>[\d.]+) (?P<xu>[GMK]iB) total capacity; (?P<used>[\d.]+) (?P<uu>[GMK]iB) already allocated; "
    r"(?P<free>[\d.]+) (?P<fu>[GMK]iB) free",
    re.I,
)
# "Process 4711 has 77.91 GiB memory in use": a process on the same GPU (torch lists each one the driver reports;
# the failing process itself among them when torch does not recognise its own, as inside containers).
OTHER_PROCESS = re.compile(
    r"Process (?P<pid>\d+) has (?P<used>[\d.]+) (?P<uu>[GMK]iB|bytes) memory in use", re.I
)
KV_CACHE, WAKE_UP, HOST, RAY_TASK_KIND = "kv-cache", "wake-up", "host", "ray-task"
# The inference engine could not place its KV cache (these stop the rollout server from starting), or could not
# map its memory back when it woke up for the next rollout.
ENGINE_ERRORS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (
        re.compile(r"No available memory for the cache blocks", re.I),
        "vLLM found no memory left for the KV cache",
        KV_CACHE,
    ),
    (
        re.compile(r"To serve at least one request with the models?'?s max seq len \((?P<len>\d+)\)", re.I),
        "vLLM's KV cache is smaller than one sequence of max_model_len",
        KV_CACHE,
    ),
    (
        re.compile(r"Free memory on device .* is less than desired GPU memory utilization", re.I),
        "vLLM found less free memory than gpu_memory_utilization asks for (the trainer still holds some)",
        KV_CACHE,
    ),
    (
        re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static", re.I),
        "SGLang's KV-cache pool does not fit in its memory fraction",
        KV_CACHE,
    ),
    (
        re.compile(r"KV cache pool .*(?:too small|not enough)", re.I),
        "SGLang's KV-cache pool is too small",
        KV_CACHE,
    ),
    (
        # "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62", "cuda error: out of memory at ...",
        # "CUDA error: out of memory      cumem_allocator.cpp:139"
        re.compile(r"CUDA Error: out of memory\s+(?:at\s+)?\S*cumem_allocator\.cpp", re.I),
        "vLLM could not map its memory back at wake-up (cumem_allocator): its gpu_memory_utilization share and "
        "what the trainer still holds do not fit the GPU together",
        WAKE_UP,
    ),
)
# Ray's memory monitor killed a worker: the node's host memory ran out, not the GPU's.
RAY_HOST_OOM = re.compile(
    r"ray\.exceptions\.OutOfMemoryError: Task was killed due to the node running low on memory", re.I
)
# A worker's out-of-memory error re-raised by Ray in the driver (torch's own message is in the worker's log).
RAY_TASK_OOM = re.compile(r"RayTaskError\(OutOfMemoryError\): ray::", re.I)
ENTROPY_FRAMES = ("entropy_from_logits",)
LOOKAHEAD = 40  # lines below Ray's host-memory error that list the workers it killed
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
RAY_TASK = re.compile(
    r"ray::[\w.]*?\.(?P<func>\w+)(?:\(|\s*$)"
)  # a task error, or Ray's list of memory users
LOOKBACK = 400  # traceback lines searched above the error
FRAME_CHARS = 2048  # of each of those lines
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")
MAX_LINE = 64 << 10
"""Bytes of one log line matched at once; a longer line is read (and matched) in pieces of this size."""
MAX_EVENTS = 1000
"""Distinct out-of-memory errors kept from the logs (the first is diagnosed; the rest are counted up to this)."""
UNITS = {"gib": 1.0, "mib": 1 / 1024, "kib": 1 / (1 << 20), "bytes": 1 / (1 << 30)}


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
    others_gib: tuple[tuple[int, float], ...] = ()
    """Other processes on the same GPU and what each holds (torch's "Process N has X GiB memory in use")."""
    in_entropy: bool = False
    """The traceback runs through verl's entropy_from_logits."""
    pytorch_gib: float | None = None
    """What PyTorch's allocator had handed out ("Of the allocated memory X is allocated by PyTorch")."""
    unallocated_gib: float | None = None
    """What PyTorch had reserved but not handed out: memory the allocator could not use (fragmentation)."""
    own_pid: int | None = None
    """The failing process's entry in torch's list, when torch did not recognise its own process (inside a
    container) and listed it as any other: its memory in use is that entry's."""

    @property
    def other_process_gib(self) -> float:
        """What other processes held on the GPU when this one failed."""
        return sum(gib for _, gib in self.others_gib)

    @property
    def signature(self) -> tuple[object, ...]:
        """What identifies the error itself: the same error printed twice (worker and driver) matches."""
        return (
            self.kind,
            self.tried_gib,
            self.gpu,
            self.total_gib,
            self.free_gib,
            self.in_use_gib,
            self.detail,
        )

    @property
    def fragmented(self) -> bool:
        """PyTorch held enough reserved-but-unallocated memory that, with the free memory, the failed allocation
        would have fit in one piece (or a large share of the GPU sat in its cache unused)."""
        spare = self.unallocated_gib or 0.0
        if spare < FRAGMENTATION_MIN_GIB:
            return False
        fits = (
            self.tried_gib is not None
            and self.free_gib is not None
            and spare + self.free_gib >= self.tried_gib
        )
        return fits or (self.total_gib is not None and spare >= FRAGMENTATION_SHARE * self.total_gib)

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
    return None if value is None else round(float(value) * UNITS.get((unit or "GiB").lower(), 1.0), 3)


def _size(text: str | None) -> float | None:
    """``"6.77 GiB"`` or ``"0 bytes"`` in GiB."""
    if text is None:
        return None
    value, unit = text.split()
    return _gib(value, unit)


def _torch_event(match: re.Match[str], where: str, line: str) -> OomEvent:
    g = match.groupdict()
    pool = TORCH_POOL.search(line)
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
        others_gib=tuple(
            (int(m["pid"]), _gib(m["used"], m["uu"]) or 0.0) for m in OTHER_PROCESS.finditer(line)
        ),
        pytorch_gib=_size(pool["alloc"]) if pool else None,
        unallocated_gib=_size(pool["spare"]) if pool else None,
    )


def _match(line: str, where: str) -> OomEvent | None:
    for pattern in (TORCH_OOM, TORCH_OOM_OLD):
        found = pattern.search(line)
        if found:
            return _torch_event(found, where, line)
    for pattern, detail, kind in ENGINE_ERRORS:
        if pattern.search(line):
            return OomEvent(where, line.strip(), kind, ROLLOUT, None, detail=detail)
    if RAY_HOST_OOM.search(line):
        detail = "Ray's memory monitor killed a worker: the node's host memory ran out (not the GPU's)"
        return OomEvent(where, line.strip(), HOST, None, None, detail=detail)
    if RAY_TASK_OOM.search(line):
        detail = "a worker ran out of memory; torch's message is in that worker's log (ray/logs/worker-*.err)"
        return OomEvent(where, line.strip(), RAY_TASK_KIND, None, None, detail=detail)
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


def scan_lines(lines: Iterable[str], label: str) -> list[OomEvent]:
    """Every distinct out-of-memory error in a stream of log lines, with its stage from the lines around it."""
    return distinct(_scan(lines, label))


@dataclass
class _Pending:
    event: OomEvent
    above: list[str]
    below: list[str]


def _scan(lines: Iterable[str], label: str) -> Iterator[OomEvent]:
    """The errors in file order. Only the last ``LOOKBACK`` lines, and the ``LOOKAHEAD`` lines below a
    host-memory error, are held: a log of any size is read in bounded memory."""
    window: deque[str] = deque(maxlen=LOOKBACK + 1)
    pending: deque[_Pending] = deque()
    for index, line in enumerate(lines):
        window.append(line[:FRAME_CHARS])
        for waiting in pending:
            if len(waiting.below) < LOOKAHEAD - 1:
                waiting.below.append(line[:FRAME_CHARS])
        while pending and len(pending[0].below) >= LOOKAHEAD - 1:
            yield _complete(pending.popleft())
        event = _match(line, f"{label}:{index + 1}")
        if event is None:
            continue
        found = _Pending(event, list(window), [])
        if pending or (event.kind == HOST and event.stage is None):  # waits for the lines below it
            pending.append(found)
        else:
            yield _complete(found)
    while pending:
        yield _complete(pending.popleft())


def _complete(found: _Pending) -> OomEvent:
    event, above = found.event, found.above
    if event.stage is None:
        # Ray's host-memory error names the killed worker's task in the lines below it
        search = [*above, *found.below] if event.kind == HOST else above
        stage, method = stage_of(search)
        event = dataclasses.replace(event, stage=stage, method=method)
    if any(FRAME.search(x) and any(f in x for f in ENTROPY_FRAMES) for x in above):
        event = dataclasses.replace(event, in_entropy=True)
    if event.others_gib:
        event = _own_entry(event, above)
    return event


PID = re.compile(r"\bpid=(\d+)")


def _own_entry(event: OomEvent, above: Sequence[str]) -> OomEvent:
    """The processes torch lists on the GPU minus the failing one, which is found by its pid in Ray's prefix or
    task error, or as the entry holding exactly what torch says this process holds, or, when torch did not
    recognise its own process (inside a container: no "this process has", or "0 bytes"), as the entry holding
    PyTorch's pool plus at most ``NON_PYTORCH_MAX_GIB``. That entry becomes the process's memory in use."""
    own = {int(m) for line in above for m in PID.findall(line)}
    entries = list(event.others_gib)
    index = next((i for i, (pid, _) in enumerate(entries) if pid in own), None)
    if index is None and event.in_use_gib:
        index = next((i for i, (_, gib) in enumerate(entries) if gib == event.in_use_gib), None)
    if index is None and not event.in_use_gib and event.pytorch_gib is not None:
        pool = event.pytorch_gib + (event.unallocated_gib or 0.0)
        fits = [
            (gib - pool, i)
            for i, (_, gib) in enumerate(entries)
            if -0.01 <= gib - pool <= NON_PYTORCH_MAX_GIB
        ]
        index = min(fits)[1] if fits else None
    if index is None:
        return event
    pid, held = entries.pop(index)
    if event.in_use_gib:  # torch knew its own process and listed it again (by the driver's pid)
        return dataclasses.replace(event, others_gib=tuple(entries))
    return dataclasses.replace(event, others_gib=tuple(entries), own_pid=pid, in_use_gib=held)


def distinct(events: Iterable[OomEvent]) -> list[OomEvent]:
    """One event per error, the first ``MAX_EVENTS``: a message printed again (by Ray in the driver, by the
    engine and its caller) is dropped, and so are Ray's re-raises of a worker's error when the worker's own
    message is in the logs (else the one that names a worker stage)."""
    seen: set[tuple[object, ...]] = set()
    out: list[OomEvent] = []
    task: list[OomEvent] = []  # the first re-raise, and the first that names a stage
    for event in events:
        if event.kind == RAY_TASK_KIND:
            if not task or (event.stage is not None and task[-1].stage is None and len(task) < 2):
                task.append(event)
        elif event.signature not in seen:
            seen.add(event.signature)
            out.append(event)
            if len(out) == MAX_EVENTS:
                break
    if out:
        return out
    named = [e for e in task if e.stage is not None]
    return (named or task)[:1]


def read_lines(file: Path, limit: int | None = None) -> Iterator[str]:
    """A log's lines, decoded leniently, one at a time; a line longer than ``MAX_LINE`` bytes comes in pieces.

    Only a regular file is read (a FIFO or a device is an InputError at once), up to ``limit`` bytes if given."""
    left = limit
    with open_regular(file, what="log") as stream:
        while line := stream.readline(MAX_LINE if left is None else min(MAX_LINE, left)):
            if left is not None:
                left -= len(line)
            yield line.decode("utf-8", "replace").rstrip("\r\n")


def log_files(path: Path) -> list[Path]:
    """The log itself, or the log-like files under a run directory (Ray's worker logs included), sorted."""
    if not path.is_dir():
        open_regular(path, what="log", where="PATH").close()  # a FIFO or a device is refused at once
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)


def find_ooms(path: Path) -> list[OomEvent]:
    """The distinct out-of-memory errors (the first ``MAX_EVENTS``) in a log file or the logs under a
    directory, in file order. Each file is streamed."""

    def every() -> Iterator[OomEvent]:
        for file in log_files(path):
            label = str(file.relative_to(path)) if path.is_dir() else str(file)
            yield from _scan(read_lines(file), label)

    return distinct(every())

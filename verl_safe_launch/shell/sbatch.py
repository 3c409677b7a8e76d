"""Read Slurm job scripts: ``#SBATCH`` directives (and ``sbatch`` options) as hardware facts with their lines."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.inputs import Fact, HardwareProfile, slurm_mem_gib
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell.job_commands import Command, CommandWalker, seeded_env
from verl_safe_launch.shell.words import (
    ArrayAssign,
    ShellSyntaxError,
    lex,
)

SHORT_FLAGS = {
    "-N": "--nodes",
    "-n": "--ntasks",
    "-c": "--cpus-per-task",
    "-t": "--time",
    "-p": "--partition",
    "-A": "--account",
    "-J": "--job-name",
    "-o": "--output",
    "-e": "--error",
    "-G": "--gpus",
    "-q": "--qos",
    "-w": "--nodelist",
    "-x": "--exclude",
    "-C": "--constraint",
    "-D": "--chdir",
    "-a": "--array",
    "-d": "--dependency",
    "-L": "--licenses",
    "-M": "--clusters",
    "-m": "--distribution",
    "-i": "--input",
    "-F": "--nodefile",
    "-S": "--core-spec",
    "-B": "--extra-node-info",
    "-O": "--overcommit",
    "-H": "--hold",
    "-W": "--wait",
    "-s": "--oversubscribe",
    "-Q": "--quiet",
    "-v": "--verbose",
}
"""sbatch's one-letter options and their long names."""

NO_VALUE = frozenset(
    {
        "--exclusive",
        "--overcommit",
        "--hold",
        "--wait",
        "--oversubscribe",
        "--quiet",
        "--verbose",
        "--requeue",
        "--no-requeue",
        "--parsable",
        "--test-only",
        "--contiguous",
        "--use-min-nodes",
        "--spread-job",
        "--ignore-pbs",
        "--reboot",
        "--no-kill",
        "--get-user-env",
    }
)
"""sbatch options that take no value (``--exclusive``'s optional value only with ``=``)."""

SLURM_VERB_OPTIONS = (
    "--nodes",
    "--cpus-per-task",
    "--mem",
    "--time",
    "--partition",
    "--account",
    "--qos",
    "--job-name",
    "--output",
)
"""Directives ``verl-safe-launch slurm`` writes itself (GPUs per node aside), in its option order."""

GPU_OPTIONS = ("--gpus-per-node", "--gres", "--gpus", "--gpus-per-task")


@dataclass(frozen=True)
class Directive:
    """One sbatch option of the job: its long name, its value, and where it was written."""

    flag: str
    value: str | None
    line: int
    raw: str
    origin: str = "#SBATCH"

    @property
    def text(self) -> str:
        """``--nodes=2``."""
        return self.flag if self.value is None else f"{self.flag}={self.value}"

    def source(self, path: str) -> Source:
        """Where the value came from, as a hardware source citing the line."""
        return Source(
            Layer.HARDWARE, file=path, line=self.line, raw=self.raw, reason=f"{self.origin} {self.text}"
        )


@dataclass(frozen=True)
class Allocation:
    """What the job asks Slurm for: each value a fact citing its directive; what sbatch would ignore."""

    path: str
    directives: tuple[Directive, ...]
    nodes: Fact[int] | None = None
    gpus_per_node: Fact[int] | None = None
    gpu_type: Fact[str] | None = None
    cpus_per_task: Fact[int] | None = None
    mem: Fact[str] | None = None
    time: Fact[str] | None = None
    problems: tuple[tuple[Directive, str], ...] = ()

    def last(self, flag: str) -> Directive | None:
        """The directive that takes effect for ``flag`` (sbatch's own options win over ``#SBATCH`` lines)."""
        found = [d for d in self.directives if d.flag == flag]
        return found[-1] if found else None

    def profile(self) -> HardwareProfile:
        """The hardware facts the pre-flight judges the launch against (host memory per node from ``--mem``)."""
        gib = slurm_mem_gib(self.mem.value) if self.mem is not None else None
        memory = Fact(gib, self.mem.source) if gib is not None and self.mem is not None else None
        return HardwareProfile(
            nodes=self.nodes, gpus_per_node=self.gpus_per_node, gpu_name=self.gpu_type, host_memory_gb=memory
        )

    def slurm_env(self) -> dict[str, str]:
        """The variables Slurm sets in the job from these options (only those the options determine)."""
        env: dict[str, str] = {}
        if self.nodes is not None:
            env["SLURM_NNODES"] = env["SLURM_JOB_NUM_NODES"] = str(self.nodes.value)
        if self.cpus_per_task is not None and self.last("--cpus-per-task") is not None:
            env["SLURM_CPUS_PER_TASK"] = str(self.cpus_per_task.value)
        gpus = self.last("--gpus-per-node")
        if gpus is not None and gpus.value:
            env["SLURM_GPUS_PER_NODE"] = gpus.value
        if self.mem is not None and slurm_mem_gib(self.mem.value) is not None:
            env["SLURM_MEM_PER_NODE"] = self.mem.value
        return env


@dataclass(frozen=True)
class JobScript:
    """A Slurm job script: its allocation, the ``#SBATCH`` lines sbatch ignores, and its commands in order."""

    path: str
    allocation: Allocation
    ignored: tuple[Directive, ...] = ()
    commands: tuple[Command, ...] = ()
    arrays: tuple[ArrayAssign, ...] = ()

    @property
    def is_job(self) -> bool:
        """True when the script carries sbatch options (``#SBATCH`` lines or its own ``sbatch`` call)."""
        return bool(self.allocation.directives or self.ignored)


def read_job_script(path: Path | str) -> JobScript:
    """Read the sbatch options and commands of a script (which must be readable UTF-8 shell)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return parse_job_script(text, str(path))


def parse_job_script(text: str, name: str) -> JobScript:
    """The job script's directives and commands; a script that is not valid shell has commands ()."""
    text = text.replace("\r\n", "\n")
    directives, ignored = _header_directives(text)
    try:
        tokens = lex(text)
    except ShellSyntaxError:
        tokens = []
    header = allocation(tuple(directives), name)
    commands, arrays = CommandWalker(seeded_env(header.slurm_env())).run(tokens)
    for command in commands:
        if command.name == "sbatch":
            directives += _command_options(command)
    return JobScript(
        name, allocation(tuple(directives), name), tuple(ignored), tuple(commands), tuple(arrays)
    )


# --- #SBATCH lines and sbatch options ---------------------------------------------------------------------


def _header_directives(text: str) -> tuple[list[Directive], list[Directive]]:
    """``#SBATCH`` lines up to the first command (sbatch reads no further), and those after it."""
    read: list[Directive] = []
    ignored: list[Directive] = []
    in_header = True
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if number == 1 and stripped.startswith("#!"):
            continue
        if stripped.startswith("#SBATCH"):
            found = _options(_split(stripped[len("#SBATCH") :]), number, stripped, "#SBATCH")
            (read if in_header else ignored).extend(found)
        elif stripped and not stripped.startswith("#"):
            in_header = False
    return read, ignored


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split("#", 1)[0].split()


def _options(words: list[str], line: int, raw: str, origin: str) -> list[Directive]:
    out: list[Directive] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-"):
            break
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            if not eq and flag not in NO_VALUE and i < len(words) and not words[i].startswith("-"):
                value, eq, i = words[i], "=", i + 1
        else:
            flag, value = SHORT_FLAGS.get(word[:2], word[:2]), word[2:]
            eq = "=" if value else ""
            if not value and flag not in NO_VALUE and i < len(words):
                value, eq, i = words[i], "=", i + 1
        out.append(Directive(flag, value if eq else None, line, raw, origin))
    return out


def _command_options(command: Command) -> list[Directive]:
    """The options of the script's own ``sbatch`` call (they win over ``#SBATCH`` lines)."""
    return _options(list(command.words[1:]), command.line, command.text, "sbatch")


# --- the allocation ----------------------------------------------------------------------------------------


def allocation(directives: tuple[Directive, ...], path: str) -> Allocation:
    """Turn directives into facts: nodes, GPUs per node (any spelling), CPUs per task, memory, time."""
    last: dict[str, Directive] = {d.flag: d for d in directives}
    problems: list[tuple[Directive, str]] = []
    nodes = _count(last.get("--nodes"), path, problems)
    per_node, gpu_type = _gpus(last, nodes, path, problems)
    cpus = _count(last.get("--cpus-per-task"), path, problems)
    per_gpu = last.get("--cpus-per-gpu")
    if cpus is None and per_gpu is not None and per_gpu.value and per_gpu.value.isdigit() and per_node:
        value = int(per_gpu.value) * per_node.value
        cpus = Fact(value, per_gpu.source(path))
    tasks = last.get("--ntasks-per-node")
    if tasks is not None and tasks.value not in (None, "1"):
        problems.append((tasks, "Ray-on-Slurm runs one task per node; the CPUs per task are then a share"))
    return Allocation(
        path,
        directives,
        nodes=nodes,
        gpus_per_node=per_node,
        gpu_type=gpu_type,
        cpus_per_task=cpus,
        mem=_text(last.get("--mem"), path),
        time=_text(last.get("--time"), path),
        problems=tuple(problems),
    )


def _text(directive: Directive | None, path: str) -> Fact[str] | None:
    if directive is None or not directive.value:
        return None
    return Fact(directive.value, directive.source(path))


def _count(directive: Directive | None, path: str, problems: list[tuple[Directive, str]]) -> Fact[int] | None:
    if directive is None:
        return None
    match = re.fullmatch(r"(\d+)(?:[-:,](\d+))?", directive.value or "")
    if match is None or int(match.group(1)) < 1:
        problems.append((directive, f"'{directive.value}' is not a count this reader understands"))
        return None
    if match.group(2) is not None:
        problems.append((directive, f"a range; the launch is judged against the minimum, {match.group(1)}"))
    return Fact(int(match.group(1)), directive.source(path))


def parse_gres(text: str) -> tuple[str | None, int] | None:
    """The GPU type and count of a ``--gres`` value (``gpu:8``, ``gpu:a100:8``, ``gpu``); None without GPUs."""
    for item in text.split(","):
        fields = re.sub(r"\(.*\)$", "", item.strip()).split(":")
        if fields[0] not in ("gpu", "gres/gpu"):
            continue
        rest = fields[1:]
        if rest and rest[-1].isdigit():
            return (rest[0] if len(rest) > 1 else None), int(rest[-1])
        return (rest[0] if rest else None), 1
    return None


def _typed_count(text: str) -> tuple[str | None, int] | None:
    """``8`` or ``h100:8`` (``--gpus-per-node``, ``--gpus``)."""
    match = re.fullmatch(r"(?:gpu:)?(?:([A-Za-z][\w.-]*):)?(\d+)", text.strip())
    if match is None:
        return None
    return match.group(1), int(match.group(2))


def _gpus(
    last: dict[str, Directive],
    nodes: Fact[int] | None,
    path: str,
    problems: list[tuple[Directive, str]],
) -> tuple[Fact[int] | None, Fact[str] | None]:
    """GPUs per node from ``--gpus-per-node``, ``--gres=gpu:…``, ``--gpus`` / nodes or ``--gpus-per-task``."""
    found: list[tuple[Directive, str | None, int]] = []
    for flag in GPU_OPTIONS:
        directive = last.get(flag)
        if directive is None or not directive.value:
            continue
        parsed = parse_gres(directive.value) if flag == "--gres" else _typed_count(directive.value)
        if parsed is None:
            if flag != "--gres":
                problems.append(
                    (directive, f"'{directive.value}' is not a GPU count this reader understands")
                )
            continue
        kind, count = parsed
        if flag == "--gpus":
            node_count = nodes.value if nodes else 1
            if count % node_count:
                problems.append(
                    (
                        directive,
                        f"{count} GPUs do not split evenly over {node_count} node(s); Slurm may place them unevenly",
                    )
                )
                continue
            count //= node_count
        if flag == "--gpus-per-task":
            tasks = last.get("--ntasks-per-node")
            count *= int(tasks.value) if tasks and tasks.value and tasks.value.isdigit() else 1
        found.append((directive, kind, count))
    if not found:
        return None, None
    first, kind, count = found[0]
    for other, _, other_count in found[1:]:
        if other_count != count:
            problems.append(
                (
                    other,
                    f"asks for {other_count} GPUs per node, but {first.text} (line {first.line}) asks for {count}",
                )
            )
    per_node = Fact(count, first.source(path))
    return per_node, (Fact(kind, first.source(path)) if kind else None)


__all__ = [
    "Allocation",
    "Directive",
    "JobScript",
    "parse_gres",
    "parse_job_script",
    "read_job_script",
]

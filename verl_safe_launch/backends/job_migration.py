"""Existing Slurm job scripts: the ``verl-safe-launch slurm`` command that replaces the job."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from verl_safe_launch.backends.bringup import LAUNCH_MARKERS
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.secret import is_secret_name
from verl_safe_launch.shell import GPU_OPTIONS, SLURM_VERB_OPTIONS, Command, Directive, JobScript


@dataclass(frozen=True)
class JobMigration:
    """The ``verl-safe-launch slurm`` options that regenerate the job, and what the options cannot say."""

    options: tuple[str, ...]
    notes: tuple[str, ...]
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int | None = None

    def command(self, configs: tuple[str, ...], tokens: tuple[str, ...], script: str) -> str:
        """The whole command line, every argument shell-quoted."""
        words = ["verl-safe-launch", "slurm", *self.options]
        for config in configs:
            words += ["-c", config]
        words += [*tokens, "-o", script]
        return " ".join(shlex.quote(w) for w in words)


def plan_job(job: JobScript, view: ConfigView | None) -> JobMigration:
    """Allocation options from the directives, setup lines, the container; notes for everything left out."""
    alloc = job.allocation
    notes: list[str] = []
    nodes = alloc.nodes.value if alloc.nodes else 1
    options = ["--nodes", str(nodes)]
    gpus = alloc.gpus_per_node.value if alloc.gpus_per_node else None
    if gpus is None:
        configured = view.get("trainer.n_gpus_per_node") if view is not None else None
        gpus = configured if isinstance(configured, int) and not isinstance(configured, bool) else 8
        notes.append(
            f"the job script asks for no GPUs; --gpus-per-node {gpus} is taken from the config: check it"
        )
    options += ["--gpus-per-node", str(gpus)]
    if alloc.gpu_type is not None:
        notes.append(
            f"the GPU type '{alloc.gpu_type.value}' ({alloc.gpu_type.source.reason}, line "
            f"{alloc.gpu_type.source.line}) is not carried over: --gpus-per-node asks for any GPU type"
        )
    if alloc.cpus_per_task is not None:
        options += ["--cpus-per-task", str(alloc.cpus_per_task.value)]
    for flag in SLURM_VERB_OPTIONS[2:]:
        directive = alloc.last(flag)
        if directive is not None and directive.value:
            options += [flag, directive.value]
    setup = read_setup(job)
    options += [arg for line in setup.lines for arg in ("--setup", line)]
    notes += setup.notes
    container, container_notes = find_container(job)
    options += container
    notes += container_notes
    notes += [
        f"not carried over: {d.raw} (line {d.line}); add it to the new job by hand" for d in extras(job)
    ]
    notes += [f"ignored by sbatch, not carried over: {d.raw} (line {d.line})" for d in job.ignored]
    cpus = alloc.cpus_per_task.value if alloc.cpus_per_task is not None else None
    return JobMigration(tuple(options), tuple(notes), nodes, gpus, cpus)


def extras(job: JobScript) -> list[Directive]:
    """Directives the ``slurm`` verb cannot express (one per option, the one that takes effect)."""
    carried = {*SLURM_VERB_OPTIONS, *GPU_OPTIONS, "--cpus-per-gpu"}
    last: dict[str, Directive] = {d.flag: d for d in job.allocation.directives}
    out: list[Directive] = []
    for flag, directive in last.items():
        if flag in carried:
            continue
        if flag == "--ntasks-per-node" and directive.value == "1":
            continue
        if flag == "--ntasks" and job.allocation.nodes and directive.value == str(job.allocation.nodes.value):
            continue
        out.append(directive)
    return sorted(out, key=lambda d: d.line)


SETUP_COMMANDS = frozenset(
    {"module", "ml", "source", ".", "conda", "mamba", "micromamba", "spack", "eval", "cd", "pushd", "export"}
    | {"ulimit", "umask", "unset"}
)
"""Commands that prepare a step's environment: carried over as ``--setup`` lines, run first in every step."""
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Setup:
    """The job's set-up, read up to its launch: the lines carried over, and a note for each one left out."""

    lines: tuple[str, ...]
    notes: tuple[str, ...]


def setup_lines(job: JobScript) -> list[str]:
    """The set-up lines carried over into ``--setup`` (see ``read_setup``)."""
    return list(read_setup(job).lines)


def read_setup(job: JobScript) -> Setup:
    """Every command before the launch (the first ``srun``, ``ray`` or verl command): environment set-up is kept,
    with the variables it reads; everything else is named, grouped by why it is left out."""
    count = _launch_index(job)
    before, after = list(job.commands[:count]), list(job.commands[count:])
    kept = [c for c in before if _is_setup(c) and _carried(c) is not None]
    wanted = _needed(kept, before)
    kept += [c for c in before if _assigns(c) & wanted and c not in kept and _carried(c) is not None]
    dropped = [c for c in before if c not in kept]
    lines = tuple(text for c in sorted(kept, key=lambda c: c.line) if (text := _carried(c)) is not None)
    secrets = [
        f"{'export ' if c.name == 'export' else ''}{name} (line {c.line}) is not carried over: it sets a secret, "
        "which never goes into a job file; export it where you run sbatch, which passes the environment to the job"
        for c in before
        for name in _secrets(c)
    ]
    return Setup(lines, (*secrets, *_notes(dropped, after)))


def _launch_index(job: JobScript) -> int:
    for index, command in enumerate(job.commands):
        if command.name in ("srun", "ray", "sbatch") or any(
            m in w for w in command.words for m in LAUNCH_MARKERS
        ):
            return index
    return len(job.commands)


def _is_setup(command: Command) -> bool:
    if not command.top_level or command.background or command.name not in SETUP_COMMANDS:
        return False
    return command.name != "export" or all("=" in r for r in command.raws[1:])  # `export NAME` sets nothing


_DECLARE = ("export", "declare", "readonly")


def _assigns(command: Command) -> set[str]:
    """The variables a plain ``NAME=value`` line (or ``export NAME``) sets; empty for any other command."""
    if not command.top_level:
        return set()
    if command.name in _DECLARE:
        return {name for r in command.raws[1:] if (name := r.partition("=")[0]).isidentifier()}
    if len(command.raws) == 1:
        name, eq, _ = command.raws[0].partition("=")
        return {name} if eq and name.isidentifier() else set()
    return set()


def _secrets(command: Command) -> list[str]:
    """The secrets a line sets (``WANDB_API_KEY=...``, ``export HF_TOKEN=...``), by name."""
    return sorted(name for name in _assigns(command) if is_secret_name(name))


def _carried(command: Command) -> str | None:
    """The line as carried over: an export without its secrets; None where nothing is left."""
    secrets = _secrets(command)
    if not secrets:
        return command.text
    rest = [r for r in command.raws[1:] if r.partition("=")[0] not in secrets]
    return " ".join([command.raws[0], *rest]) if command.name == "export" and rest else None


def _needed(kept: list[Command], before: list[Command]) -> set[str]:
    """The variables the kept lines read, and those the assignments of them read in turn."""
    assignments = {name: c for c in before for name in _assigns(c) if not is_secret_name(name)}
    wanted: set[str] = set()
    todo = [name for c in kept for name in _VARIABLE.findall(c.text)]
    while todo:
        name = todo.pop()
        if name in wanted or name not in assignments:
            continue
        wanted.add(name)
        todo += _VARIABLE.findall(assignments[name].text)
    return wanted


_OUTPUT_ONLY = frozenset(
    {"echo", "printf", "date", "hostname", "nvidia-smi", "sleep", "env", "printenv", "pwd"}
)


def _notes(dropped: list[Command], after: list[Command]) -> list[str]:
    """Why each left-out line is left out; the usual kinds (values, Ray bring-up, output) one note each."""
    launches = [c for c in after if any(m in w for w in c.words for m in LAUNCH_MARKERS)]
    launch_reads = {name for c in launches for name in _VARIABLE.findall(c.text)}
    groups: dict[str, list[Command]] = {}
    notes: list[str] = []
    for command in dropped:
        names = _assigns(command)
        if _secrets(command):
            continue  # named above, by the secret it sets
        if names and names & launch_reads:
            groups.setdefault("the launch read them; their values are in the YAML", []).append(command)
        elif names:
            groups.setdefault("no set-up line reads them (the job brings Ray up itself)", []).append(command)
        elif command.name in _OUTPUT_ONLY:
            groups.setdefault("output and waits only", []).append(command)
        elif not command.top_level or command.background:
            kind = "runs in the background" if command.background else "is inside an if, case or loop"
            notes.append(
                f"not carried over: {command.text} (line {command.line}): it {kind}; add it with --setup if every step needs it"
            )
        else:
            notes.append(
                f"not carried over: {command.text} (line {command.line}): a step of its own, not environment set-up; "
                "run it before submitting, or add it with --setup if every step on every node must run it"
            )
    for why, commands in groups.items():
        what = ", ".join(f"{'/'.join(sorted(_assigns(c))) or c.name} (line {c.line})" for c in commands)
        notes.insert(0, f"not carried over, {why}: {what}")
    return notes


def find_container(job: JobScript) -> tuple[list[str], list[str]]:
    """``--container IMAGE --container-runtime R`` from apptainer/singularity or pyxis, with notes."""
    commands = [
        c
        for c in job.commands
        if c.has("ray", "start") or any(m in w for w in c.words for m in LAUNCH_MARKERS)
    ]
    for command in commands:
        image = command.option("--container-image")
        if image is not None:
            return ["--container", image, "--container-runtime", "pyxis"], _unresolved(image, command)
        for i, word in enumerate(command.words[:-2]):
            runtime = word.rsplit("/", 1)[-1]
            if runtime in ("apptainer", "singularity") and command.words[i + 1] in ("exec", "run"):
                image = _container_image(command.words[i + 2 :])
                if image is not None:
                    notes = _unresolved(image, command)
                    notes.append(
                        f"{runtime}'s own options on line {command.line} are not carried over "
                        "(the job binds its own directories)"
                    )
                    return ["--container", image, "--container-runtime", runtime], notes
        other = next((w for w in ("docker", "podman", "enroot") if w in command.words), None)
        if other is not None:
            note = (
                f"line {command.line} runs in a container with {other}: verl-safe-launch slurm starts steps "
                "with apptainer, singularity or pyxis only; add --container IMAGE --container-runtime yourself"
            )
            return [], [note]
    return [], []


_CONTAINER_VALUE_OPTIONS = frozenset(
    {
        "-B",
        "--bind",
        "--env",
        "--env-file",
        "-H",
        "--home",
        "--overlay",
        "-o",
        "--pwd",
        "-W",
        "--workdir",
        "--mount",
    }
)


def _container_image(words: tuple[str, ...]) -> str | None:
    i = 0
    while i < len(words):
        word = words[i]
        if word in _CONTAINER_VALUE_OPTIONS:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            return word
    return None


def _unresolved(image: str, command: Command) -> list[str]:
    if "$" in image:
        return [
            f"the container image {image} (line {command.line}) depends on a variable the script does not "
            "set: replace it"
        ]
    return []


__all__ = [
    "SETUP_COMMANDS",
    "JobMigration",
    "Setup",
    "extras",
    "find_container",
    "plan_job",
    "read_setup",
    "setup_lines",
]

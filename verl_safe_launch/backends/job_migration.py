"""Existing Slurm job scripts: the ``verl-safe-launch slurm`` command that replaces the job."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from verl_safe_launch.backends.bringup import LAUNCH_MARKERS
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.secret import is_secret_name
from verl_safe_launch.shell import GPU_OPTIONS, SLURM_VERB_OPTIONS, Command, Directive, JobScript

_SETUP_COMMANDS = frozenset({"module", "ml", "source", ".", "conda", "mamba", "micromamba", "spack"})


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
    options += [arg for line in setup_lines(job) for arg in ("--setup", line)]
    notes += [
        f"export {name} (line {line}) is not carried over: a secret is never written into a job file; export it "
        "where you run sbatch, which passes the environment to the job"
        for name, line in secret_exports(job)
    ]
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


def setup_lines(job: JobScript) -> list[str]:
    """Environment set-up the steps need (module load, source/conda activate, plain exports), as written; an
    export of a secret (``secret_exports``) is left out."""
    lines: list[str] = []
    for command in _setup_commands(job):
        if command.name != "export" or not _exported_secrets(command):
            lines.append(command.text)
            continue
        kept = [raw for raw in command.raws[1:] if not is_secret_name(raw.partition("=")[0])]
        if kept:
            lines.append(" ".join([command.raws[0], *kept]))
    return lines


def secret_exports(job: JobScript) -> list[tuple[str, int]]:
    """The secrets the set-up exports (``export WANDB_API_KEY=...``), by name, with their lines."""
    return [
        (name, c.line) for c in _setup_commands(job) if c.name == "export" for name in _exported_secrets(c)
    ]


def _setup_commands(job: JobScript) -> list[Command]:
    found: list[Command] = []
    for command in job.commands:
        if command.name in ("srun", "ray") or command.has("ray", "start"):
            break
        if not command.top_level or command.background:
            continue
        if command.name in _SETUP_COMMANDS or (
            command.name == "export"
            and all("=" in r and not re.search(r"[$`]", r) for r in command.raws[1:])
            and len(command.raws) > 1
        ):
            found.append(command)
    return found


def _exported_secrets(command: Command) -> list[str]:
    names = [raw.partition("=")[0] for raw in command.raws[1:]]
    return [name for name in names if is_secret_name(name)]


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


__all__ = ["JobMigration", "extras", "find_container", "plan_job", "secret_exports", "setup_lines"]

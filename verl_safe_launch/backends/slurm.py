"""Render a Slurm batch script that brings up Ray on every allocated node and runs the pre-flighted launch."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from verl_safe_launch.compose import Composed
from verl_safe_launch.config_view import ConfigView, is_missing
from verl_safe_launch.errors import UsageError
from verl_safe_launch.provenance import Layer

PROGRAM = "verl-safe-launch"
RUNTIMES = ("apptainer", "singularity", "pyxis")
DEFAULT_JOIN_TIMEOUT_S = 600
TEMPLATE = "templates/job.sh"
TEMPLATE_MARK = "# vsl-template: "
# sbatch reads '#SBATCH' lines with its own parser: a backslash escapes, a line cannot continue.
_SBATCH_UNSAFE = ("\n", "\r", "\0", "\\")


@dataclass(frozen=True)
class Container:
    """An image every step runs in, and the runtime that starts it."""

    image: str
    runtime: str = "apptainer"


@dataclass(frozen=True)
class SlurmSpec:
    """Everything the batch script says: the allocation, the files it reads and what runs on the nodes.

    ``config`` and ``log_root`` appear in the script as given (the command line passes absolute paths).
    ``overrides`` are the few tokens a YAML layer cannot hold (config-group choices, deletions);
    ``run_args`` are extra options of ``verl-safe-launch run`` (for example ``--dry-run``).
    """

    nodes: int
    gpus_per_node: int
    config: str
    log_root: str
    job_name: str = "verl"
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    output: str | None = None
    setup: tuple[str, ...] = ()
    container: Container | None = None
    overrides: tuple[str, ...] = ()
    run_args: tuple[str, ...] = ()
    join_timeout_s: int = DEFAULT_JOIN_TIMEOUT_S


def sbatch_options(spec: SlurmSpec) -> list[tuple[str, str]]:
    """The ``#SBATCH`` flags and values, sorted by flag."""
    options = {
        "--nodes": str(spec.nodes),
        "--ntasks-per-node": "1",
        "--gpus-per-node": str(spec.gpus_per_node),
        "--job-name": spec.job_name,
        "--cpus-per-task": None if spec.cpus_per_task is None else str(spec.cpus_per_task),
        "--mem": spec.mem,
        "--time": spec.time,
        "--partition": spec.partition,
        "--account": spec.account,
        "--qos": spec.qos,
        "--output": spec.output,
    }
    return sorted((flag, value) for flag, value in options.items() if value is not None)


MAX_NODES = 100_000
_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}")
_MEM = re.compile(r"[0-9]+[KMGT]?", re.IGNORECASE)
_WHOLE = re.compile(r"[0-9]{1,12}")


def count_arg(text: str) -> int:
    """A count option (``--nodes``, ``--gpus-per-node``, ``--cpus-per-task``): a whole number 1..100000."""
    if not _WHOLE.fullmatch(text) or not 1 <= int(text) <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to {MAX_NODES}")
    return int(text)


def time_arg(text: str) -> str:
    """``--time`` in one of Slurm's formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or UNLIMITED."""
    if text.upper() in ("UNLIMITED", "INFINITE") or _TIME.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a Slurm time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 24:00:00)"
    )


def mem_arg(text: str) -> str:
    """``--mem`` in Slurm's format: a whole number with an optional K, M, G or T suffix (megabytes without)."""
    if _MEM.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a Slurm memory size: a whole number with an optional K, M, G or T suffix (e.g. 480G)"
    )


def seconds_arg(text: str) -> int:
    """A timeout in whole seconds, at least 1."""
    if not _WHOLE.fullmatch(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds, at least 1")
    return int(text)


def validate_spec(spec: SlurmSpec) -> None:
    """Raise a UsageError for anything the script cannot say exactly."""
    if spec.nodes < 1 or spec.gpus_per_node < 1:
        raise UsageError(
            f"--nodes {spec.nodes} --gpus-per-node {spec.gpus_per_node}: both must be at least 1",
            where="command line (verl-safe-launch slurm)",
            fix="for example --nodes 2 --gpus-per-node 8",
        )
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise UsageError(f"--cpus-per-task {spec.cpus_per_task} must be at least 1", fix="--cpus-per-task 32")
    for flag, value in sbatch_options(spec):
        bad = next((c for c in _SBATCH_UNSAFE if c in value), None)
        if bad is not None or not value.strip():
            what = "is empty" if bad is None else f"contains {bad!r}"
            raise UsageError(
                f"{flag} {value!r} {what}, which an '#SBATCH' line cannot carry",
                where=f"command line ({flag})",
                fix=f"pass {flag} without line breaks or backslashes",
            )
    if spec.container is not None:
        _validate_container(spec, spec.container)


def _validate_container(spec: SlurmSpec, container: Container) -> None:
    if container.runtime not in RUNTIMES:
        raise UsageError(
            f"unknown container runtime '{container.runtime}'",
            where="command line (--container-runtime)",
            fix="use one of: " + ", ".join(RUNTIMES),
        )
    bad = [d for d in _binds(spec) if "," in d or ":" in d]
    if bad:
        flag = "--container-mounts" if container.runtime == "pyxis" else "--bind"
        raise UsageError(
            f"{bad[0]} contains ',' or ':', which {container.runtime}'s {flag} reads as separators",
            where="command line (-o)",
            fix="write the job into a directory without ',' or ':' in its path",
        )


def _array(name: str, items: Sequence[str]) -> str:
    return f"{name}=(" + " ".join(_element(item) for item in items) + ")"


def _element(item: str) -> str:
    """One array element, shell-quoted; quoted also when it holds a comma, which reads as a separator."""
    quoted = shlex.quote(item)
    return f"'{item}'" if quoted == item and "," in item else quoted


def _container_arrays(spec: SlurmSpec) -> tuple[list[str], list[str]]:
    """(srun options, command prefix) that put every step inside the container."""
    if spec.container is None:
        return [], []
    image = spec.container.image
    binds = _binds(spec)
    if spec.container.runtime == "pyxis":
        return [f"--container-image={image}", "--container-mounts=" + ",".join(f"{d}:{d}" for d in binds)], []
    bind = [arg for d in binds for arg in ("--bind", d)]
    return [], [spec.container.runtime, "exec", "--nv", *bind, image]


def _binds(spec: SlurmSpec) -> list[str]:
    """The directories a container must see: the config's and the logs' (one when nested)."""
    dirs = sorted({_parent(spec.config), spec.log_root})
    return [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]


def _parent(path: str) -> str:
    head, _, _ = path.rpartition("/")
    return head or "."


def render_sbatch(spec: SlurmSpec) -> str:
    """The batch script: deterministic, ``#SBATCH`` flags sorted, every rendered value shell-quoted."""
    validate_spec(spec)
    sbatch = [f"#SBATCH {flag}={shlex.quote(value)}" for flag, value in sbatch_options(spec)]
    srun_extra, wrap = _container_arrays(spec)
    variables = [
        f"VSL_CONFIG={shlex.quote(spec.config)}",
        f"VSL_LOG_ROOT={shlex.quote(spec.log_root)}",
        f"VSL_JOIN_TIMEOUT={int(spec.join_timeout_s)}",
        _array("VSL_OVERRIDES", spec.overrides),
        _array("VSL_RUN_ARGS", spec.run_args),
        _array("VSL_SRUN_CONTAINER", srun_extra),
        _array("VSL_WRAP", wrap),
        f"export VSL_SETUP={shlex.quote(chr(10).join(spec.setup))}",
    ]
    return fill_template(job_template(), {"sbatch": "\n".join(sbatch), "variables": "\n".join(variables)})


def job_template() -> str:
    """The job's bash body (``templates/job.sh``), with a ``# vsl-template: NAME`` line where values go."""
    return resources.files("verl_safe_launch.backends").joinpath(TEMPLATE).read_text(encoding="utf-8")


def fill_template(template: str, parts: dict[str, str]) -> str:
    """Replace each ``# vsl-template: NAME`` line with ``parts[NAME]`` (already rendered and quoted)."""
    lines = template.split("\n")
    for name, text in parts.items():
        marker = TEMPLATE_MARK + name
        if lines.count(marker) != 1:
            raise ValueError(f"{TEMPLATE} must hold the line '{marker}' once")
        lines[lines.index(marker)] = text
    return "\n".join(lines)


YAML_TITLE = (
    "# The verl config of a verl-safe-launch Slurm job: every value set above verl's defaults (preset, user\n"
    "# files, command line, hardware), as composed when the job was written. Read with: verl-safe-launch run -c\n"
)


def user_layer(view: ConfigView) -> dict[str, Any]:
    """Every leaf a layer above verl's defaults set, by dotted key: its final value, an interpolation as written."""
    values: dict[str, Any] = {}
    for key in sorted(view.keys()):
        prov = view.prov(key)
        if prov is None or prov.source.layer is Layer.VERL or is_missing(view.get(key)):
            continue
        values[key] = prov.interpolation if prov.interpolation is not None else view.get(key)
    return values


def argv_overrides(composed: Composed) -> tuple[str, ...]:
    """The overrides a YAML layer cannot hold: config-group choices and deletions, as written."""
    wrote_value = {write.source for write in composed.writes if not write.delete}
    return tuple(token.text for token in composed.verl_overrides if token.source not in wrote_value)


def render_user_yaml(values: dict[str, Any]) -> str:
    """The user layer as YAML (dotted keys, sorted), read back by composition as one user file."""
    import yaml

    body = yaml.safe_dump(values, sort_keys=True, default_flow_style=False, allow_unicode=True, width=2**20)
    return YAML_TITLE + body

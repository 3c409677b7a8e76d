"""Existing Slurm job scripts: the Ray-on-Slurm bring-up lint, one rule table."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.findings import Finding, Rule, Severity
from verl_safe_launch.inputs import Fact
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.rules import CpuNeed, cpu_need, gpu_need
from verl_safe_launch.shell import Command, JobScript

LAUNCH_MARKERS = ("verl.trainer.main_ppo", "verl/trainer/main_ppo.py", "-mverl.trainer.main_ppo")
MIGRATE_HINT = "or replace the job: verl-safe-launch migrate {path} -o DIR"
_HOST_IP = re.compile(r"\bhostname\s+(?:-\w*[iI]\w*|--ip-address|--all-ip-addresses)\b")


@dataclass(frozen=True)
class BringupContext:
    """What a bring-up rule reads: the job script, and the composed config of its verl launch (when known)."""

    job: JobScript
    view: ConfigView | None = None

    @property
    def path(self) -> str:
        """The script's path as given."""
        return self.job.path

    @property
    def ray_starts(self) -> tuple[Command, ...]:
        """Every ``ray start`` of the script, in order."""
        return tuple(c for c in self.job.commands if c.has("ray", "start"))

    @property
    def launches(self) -> tuple[Command, ...]:
        """Every command that runs verl's trainer."""
        return tuple(c for c in self.job.commands if any(m in w for w in c.words for m in LAUNCH_MARKERS))

    @property
    def multi_node(self) -> bool:
        """True unless the allocation is known to be one node."""
        nodes = self.job.allocation.nodes
        return nodes is None or nodes.value > 1


BringupCheck = Callable[[BringupContext], list[Finding]]


def _finding(
    ctx: BringupContext, rule_id: str, severity: Severity, line: int, raw: str, message: str, fix: str
) -> Finding:
    source = Source(Layer.SCRIPT, ctx.path, line)
    shown = raw if len(raw) <= 72 else raw[:68] + " ..."
    return Finding(rule_id, severity, (), f"line {line}: {message}", fix, (("line", shown, source),))


def _rule(
    rule_id: str, description: str, severity: Severity
) -> Callable[[BringupCheck], Rule[BringupContext]]:
    def make(fn: BringupCheck) -> Rule[BringupContext]:
        return Rule(rule_id, description, severity, fn)

    return make


@_rule(
    "slurm-directive",
    "#SBATCH lines sbatch ignores or this reader cannot turn into an allocation",
    Severity.WARNING,
)
def directives(ctx: BringupContext) -> list[Finding]:
    """sbatch stops reading ``#SBATCH`` at the first command; conflicting or unreadable GPU and node counts."""
    found = [
        _finding(
            ctx,
            "slurm-directive",
            Severity.WARNING,
            d.line,
            d.raw,
            f"{d.raw} comes after the first command, and sbatch reads #SBATCH lines only before it: "
            "this option is ignored",
            "move it up to the other #SBATCH lines",
        )
        for d in ctx.job.ignored
    ]
    found += [
        _finding(
            ctx, "slurm-directive", Severity.WARNING, d.line, d.raw, f"{d.text}: {why}", "check the directive"
        )
        for d, why in ctx.job.allocation.problems
    ]
    return found


@_rule("slurm-nodes-array", "the node list split into one array element per host", Severity.ERROR)
def nodes_array(ctx: BringupContext) -> list[Finding]:
    """``nodes_array=("$nodes")`` keeps every host in one element: no worker ever joins on 2+ nodes."""
    if not any(
        c.has("scontrol", "show", "hostnames") or "scontrol show hostname" in c.text for c in ctx.job.commands
    ):
        return []
    found: list[Finding] = []
    for array in ctx.job.arrays:
        if len(array.items) != 1:
            continue
        parts = array.items[0].parts
        if not parts or not all(p.quoted for p in parts) or not any(p.kind.value == "var" for p in parts):
            continue
        severity = Severity.ERROR if ctx.multi_node else Severity.WARNING
        word = array.items[0].raw
        message = (
            f"{array.raw} puts the whole node list into ONE array element ({word} is quoted), so "
            f"${{{array.name}[0]}} holds every host and ${{{array.name}[1]}} is empty: no worker ever joins "
            "when the job has 2 or more nodes"
        )
        fix = f'mapfile -t {array.name} < <(scontrol show hostnames "$SLURM_JOB_NODELIST")'
        found.append(_finding(ctx, "slurm-nodes-array", severity, array.line, array.raw, message, fix))
    return found


@_rule("slurm-fixed-sleep", "readiness waits, not fixed sleeps, after starting Ray", Severity.WARNING)
def fixed_sleep(ctx: BringupContext) -> list[Finding]:
    """A ``sleep N`` after ``ray start`` guesses how long the nodes take: too short fails, too long wastes."""
    starts = ctx.ray_starts
    if not starts:
        return []
    first = ctx.job.commands.index(starts[0])
    found: list[Finding] = []
    for command in ctx.job.commands[first + 1 :]:
        if command.name != "sleep" or command.polling or command.background:
            continue
        message = (
            f"'{command.text}' waits a fixed time for Ray to come up: on a slow node the next step starts "
            "too early (workers fail to join, or verl sees fewer GPUs), on a fast one the time is wasted"
        )
        fix = (
            'wait for readiness: until ray status --address="$ip_head" >/dev/null 2>&1; do sleep 1; done, '
            "then poll until ray status lists $SLURM_JOB_NUM_NODES nodes; "
            + MIGRATE_HINT.format(path=ctx.path)
        )
        found.append(
            _finding(ctx, "slurm-fixed-sleep", Severity.WARNING, command.line, command.text, message, fix)
        )
    return found


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


@_rule(
    "slurm-ray-resources", "ray start with --num-cpus / --num-gpus matching the allocation", Severity.ERROR
)
def ray_resources(ctx: BringupContext) -> list[Finding]:
    """Without them Ray counts the node's CPUs (or its cgroup's) and the GPUs it sees, not the allocation."""
    alloc = ctx.job.allocation
    found: list[Finding] = []
    for command in ctx.ray_starts:
        found += _ray_count(
            ctx, command, "--num-cpus", alloc.cpus_per_task, "CPUs per task", "SLURM_CPUS_PER_TASK"
        )
        found += _ray_count(
            ctx, command, "--num-gpus", alloc.gpus_per_node, "GPUs per node", "SLURM_GPUS_PER_NODE"
        )
    return found


def _ray_count(
    ctx: BringupContext, command: Command, flag: str, fact: Fact[int] | None, noun: str, variable: str
) -> list[Finding]:
    value, raw = command.option(flag), command.raw_option(flag)
    have = fact.value if fact is not None else None
    env = "${SLURM_CPUS_PER_TASK}" if flag == "--num-cpus" else "${SLURM_GPUS_ON_NODE}"
    if value is None:
        counted = "the node's CPUs (or its cgroup's)" if flag == "--num-cpus" else "the GPUs it can see"
        message = f"ray start without {flag}: Ray counts {counted}, not the {noun} Slurm allocated"
        if flag == "--num-cpus":
            message += ", and verl's CPU reservations can then hang (too few) or oversubscribe (too many)"
        fix = f'add {flag}="{env}"' + (f" ({have} here)" if have is not None else "")
        return [
            _finding(ctx, "slurm-ray-resources", Severity.WARNING, command.line, command.text, message, fix)
        ]
    number = _int(value)
    if number is not None and fact is not None and number != fact.value:
        severity = Severity.ERROR if flag == "--num-gpus" and number > fact.value else Severity.WARNING
        message = f"ray start {flag}={number}, but the allocation has {have} {noun} ({_cite(fact)})"
        return [
            _finding(
                ctx, "slurm-ray-resources", severity, command.line, command.text, message, f'{flag}="{env}"'
            )
        ]
    if raw is not None and variable in raw and variable not in ctx.job.allocation.slurm_env():
        why = (
            "the job script does not set --cpus-per-task"
            if flag == "--num-cpus"
            else "the job asks for GPUs with --gres/--gpus, not --gpus-per-node"
        )
        message = f"ray start {flag} {raw}: Slurm leaves ${variable} empty here ({why}), so Ray gets no {noun} count"
        return [
            _finding(
                ctx,
                "slurm-ray-resources",
                Severity.ERROR,
                command.line,
                command.text,
                message,
                f'{flag}="{env}"',
            )
        ]
    return []


def _cite(fact: Fact[int] | None) -> str:
    if fact is None:
        return "the allocation"
    return f"{fact.source.reason}, line {fact.source.line}"


@_rule("slurm-ray-cpus", "Ray's CPUs per node cover what the trainer reserves there", Severity.ERROR)
def ray_cpus(ctx: BringupContext) -> list[Finding]:
    """verl reserves 3 CPUs per GPU bundle (plus TransferQueue on the head); with fewer it waits forever."""
    if ctx.view is None or not ctx.ray_starts:
        return []
    head = next((c for c in ctx.ray_starts if "--head" in c.words), ctx.ray_starts[0])
    given = None if "SLURM_CPUS" in (head.raw_option("--num-cpus") or "") else _int(head.option("--num-cpus"))
    alloc = ctx.job.allocation
    have = given if given is not None else (alloc.cpus_per_task.value if alloc.cpus_per_task else None)
    configured = ctx.view.get("trainer.nnodes")
    nodes = configured if isinstance(configured, int) and configured > 0 else 1
    if have is None:
        return []
    need, bundles, per_node = ray_cpus_per_node(ctx.view, nodes)
    if have >= per_node:
        return []
    where = (
        "--num-cpus on the head's ray start"
        if given is not None
        else f"--cpus-per-task ({_cite(alloc.cpus_per_task)})"
    )
    line = (
        head.line
        if given is not None or alloc.cpus_per_task is None
        else alloc.cpus_per_task.source.line or head.line
    )
    message = (
        f"Ray gets {have} CPUs per node from {where}, but this run reserves {need.describe()} Ray CPUs: "
        f"{bundles} on every node and {per_node} on the head; verl waits forever for the rest"
    )
    fix = f'--cpus-per-task={per_node} in the #SBATCH lines, and ray start --num-cpus="${{SLURM_CPUS_PER_TASK}}"'
    return [_finding(ctx, "slurm-ray-cpus", Severity.ERROR, line, head.text, message, fix)]


def ray_cpus_per_node(view: ConfigView, nodes: int) -> tuple[CpuNeed, int, int]:
    """The run's Ray CPU need, its GPU bundles on every node, and everything the head node must hold."""
    need = cpu_need(view, gpu_need(view))
    bundles = math.ceil(need.gpu_bundles / max(nodes, 1))
    return need, bundles, bundles + need.transfer_queue + need.headroom


def cpus_per_task(view: ConfigView, given: int | None, nodes: int) -> tuple[int, Finding | None]:
    """``--cpus-per-task`` of a generated job: what the run reserves per node by default; a finding when the one
    given is fewer."""
    need, bundles, per_node = ray_cpus_per_node(view, nodes)
    if given is None:
        return per_node, None
    if given >= bundles and given * nodes >= need.total:
        return given, None
    return given, Finding(
        "slurm-ray-cpus",
        Severity.ERROR,
        ("trainer.n_gpus_per_node",),
        f"--cpus-per-task {given} gives Ray {given} CPUs per node, but this run reserves "
        f"{need.describe()} Ray CPUs, {bundles} of them on every node; verl would wait forever for them",
        f"--cpus-per-task {per_node} (or leave it out: that is the default)",
        (("--cpus-per-task", given, Source(Layer.CLI, raw=f"--cpus-per-task {given}")),),
    )


@_rule("slurm-head-address", "the head address from a chosen interface, not hostname -i/-I", Severity.WARNING)
def head_address(ctx: BringupContext) -> list[Finding]:
    """``hostname --ip-address`` / ``-I`` return whatever the resolver or the first interface gives."""
    found: list[Finding] = []
    for command in ctx.job.commands:
        match = _HOST_IP.search(command.text)
        if match is None:
            continue
        message = (
            f"the head address comes from '{match.group(0)}', which returns what /etc/hosts or the first "
            "interface says (a loopback, an IPv6 or a management address): workers may then dial the wrong network"
        )
        fix = (
            "choose the interface: ip -4 -o addr show dev IFACE | awk '{print $4}' | cut -d/ -f1 "
            "(IFACE being the fabric Ray should use), and pass it to ray start --node-ip-address"
        )
        found.append(
            _finding(ctx, "slurm-head-address", Severity.WARNING, command.line, command.text, message, fix)
        )
    return found


@_rule(
    "slurm-driver-overlap",
    "the driver step shares the head node with the Ray step (--overlap)",
    Severity.ERROR,
)
def driver_overlap(ctx: BringupContext) -> list[Finding]:
    """Since Slurm 20.11 a step does not share CPUs/GPUs with running steps unless it asks with --overlap."""
    if not any(c.name == "srun" for c in ctx.ray_starts):
        return []
    if any("SLURM_OVERLAP" in c.text for c in ctx.job.commands):
        return []
    found: list[Finding] = []
    for command in ctx.launches:
        if command.name != "srun":
            continue
        if "--overlap" not in command.words:
            message = (
                "the verl launch runs as an srun step without --overlap while the Ray steps hold the node's "
                "CPUs and GPUs: Slurm (20.11 and later) keeps it waiting for them, so the driver never starts"
            )
            fix = 'srun --overlap --nodes=1 --ntasks=1 -w "$head_node" python3 -m verl.trainer.main_ppo ...'
            found.append(
                _finding(
                    ctx, "slurm-driver-overlap", Severity.ERROR, command.line, command.text, message, fix
                )
            )
        elif ctx.multi_node and command.option("-w", "--nodelist") is None:
            message = (
                "the verl launch's srun step does not name the head node, so Slurm may run it on any node"
            )
            fix = 'add -w "$head_node" (the node whose ray start has --head)'
            found.append(
                _finding(
                    ctx, "slurm-driver-overlap", Severity.WARNING, command.line, command.text, message, fix
                )
            )
    return found


@_rule(
    "slurm-ray-block",
    "Ray steps stay up (--block, in the background) and the job waits for the launch",
    Severity.ERROR,
)
def ray_block(ctx: BringupContext) -> list[Finding]:
    """Without --block srun's step ends at once and Slurm stops its Ray processes; a job script ends its job."""
    found: list[Finding] = []
    for command in ctx.ray_starts:
        if command.name == "srun" and "--block" not in command.words:
            message = (
                "ray start under srun without --block returns as soon as Ray is up: the step then ends and "
                "Slurm stops the Ray processes it started, so the node leaves the cluster"
            )
            fix = "add --block and run the step in the background: srun ... ray start ... --block &"
            found.append(
                _finding(ctx, "slurm-ray-block", Severity.ERROR, command.line, command.text, message, fix)
            )
        elif "--block" in command.words and not command.background:
            message = "ray start --block runs in the foreground: it never returns, so the rest of the script never runs"
            fix = "end the line with ' &'"
            found.append(
                _finding(ctx, "slurm-ray-block", Severity.ERROR, command.line, command.text, message, fix)
            )
    launches = ctx.launches
    if launches and launches[-1].background:
        last = ctx.job.commands.index(launches[-1])
        if not any(c.name == "wait" for c in ctx.job.commands[last + 1 :]):
            command = launches[-1]
            message = (
                "the verl launch runs in the background and nothing waits for it: the script ends, and Slurm "
                "ends the job (and the launch) with it"
            )
            found.append(
                _finding(
                    ctx,
                    "slurm-ray-block",
                    Severity.ERROR,
                    command.line,
                    command.text,
                    message,
                    "add 'wait' after it",
                )
            )
    return found


BRINGUP_RULES: tuple[Rule[BringupContext], ...] = (
    directives,
    nodes_array,
    fixed_sleep,
    ray_resources,
    ray_cpus,
    head_address,
    driver_overlap,
    ray_block,
)
"""The Ray-on-Slurm bring-up lint, in report order."""


def bringup_findings(job: JobScript, view: ConfigView | None = None) -> list[Finding]:
    """Run every bring-up rule on a job script (a script without ``#SBATCH`` lines or Ray gets none)."""
    if not job.is_job and not any(c.has("ray", "start") for c in job.commands):
        return []
    ctx = BringupContext(job, view)
    return [f for rule in BRINGUP_RULES for f in rule(ctx)]


__all__ = [
    "BRINGUP_RULES",
    "LAUNCH_MARKERS",
    "MIGRATE_HINT",
    "BringupContext",
    "bringup_findings",
    "cpus_per_task",
    "ray_cpus_per_node",
]

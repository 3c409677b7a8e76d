"""Whole launch scripts through the pre-flight: every launch of a script (each world of its branches, or what
bash really ran under ``--trace``), judged by what was read."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from verl_safe_launch.audit import (
    Reading,
    across_worlds,
    audit,
    deciding_parts,
    group_older_keys,
    qualify,
    refused_whatever_the_value,
    script_findings,
    settle_command,
)
from verl_safe_launch.compose import Overlay, config_groups, model_engines
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.errors import ConfigError, InputError, VslError
from verl_safe_launch.findings import Finding, Severity, verdict
from verl_safe_launch.inputs import (
    DETECT_ENV,
    HardwareProfile,
    OverrideToken,
    detect_hardware,
    merge_profiles,
    split_tool_tokens,
    verl_package_dir,
    verl_release,
)
from verl_safe_launch.preflight.pipeline import run_preflight
from verl_safe_launch.preflight.release import header_lines, use_project_verl
from verl_safe_launch.preflight.tree import skip_reason
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell import (
    JobScript,
    NoLaunch,
    ScriptLaunch,
    ScriptNote,
    read_job_script,
    read_script,
    seeded_env,
    trace_script,
    traced_launches,
)

JobLint = Callable[[JobScript, ConfigView | None], list[Finding]]
"""Findings about a Slurm job script itself, given the composed config of its launch."""


@dataclass(frozen=True)
class TraceOptions:
    """``--trace``: run the script under bash with this environment and time limit."""

    env: dict[str, str]
    timeout: float


@dataclass(frozen=True)
class LaunchAudit:
    """One launch of a script and everything the pre-flight found in it."""

    launch: ScriptLaunch
    findings: tuple[Finding, ...]
    unread: int = 0
    settle: str | None = None
    """The audit command that reads what was left unread (an UNVERIFIED launch's way forward)."""
    baselined: tuple[Finding, ...] = ()
    """Findings a baseline accepted: shown as counted, never failing the gate."""

    @property
    def verdict(self) -> str:
        """``go``, ``no-go`` or ``unverified`` (parts of the launch were not read)."""
        return verdict(self.findings, self.unread)


@dataclass(frozen=True)
class ScriptAudit:
    """One script: its launches, or the error that kept it from being read."""

    path: str
    launches: tuple[LaunchAudit, ...] = ()
    error: VslError | None = None
    verl: tuple[str, ...] = ()
    """The report header: the verl its launches import, and what could not be judged for it."""
    skipped: str | None = None
    """Why a script with no verl PPO launch (SFT, generation, data preparation) was not audited."""
    named: bool = True
    """Named on the command line (unreadable: an unusable command line), not found in a folder."""

    @property
    def verdict(self) -> str:
        """Over the script's launches: ``no-go``, ``unverified``, ``go``; ``skipped`` or ``unreadable``."""
        if self.error is not None:
            return "unreadable"
        if self.skipped is not None or not self.launches:
            return "skipped"
        verdicts = {launch.verdict for launch in self.launches}
        return next(v for v in ("no-go", "unverified", "go") if v in verdicts or v == "go")


class Auditor:
    """Audits scripts one after another, sharing verl's composed defaults between them; a Slurm job's own
    lint (its Ray bring-up) comes from ``job_findings``."""

    def __init__(
        self,
        passthrough: tuple[OverrideToken, ...] = (),
        hardware: HardwareProfile | None = None,
        trace: TraceOptions | None = None,
        job_findings: JobLint | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.passthrough = passthrough
        self.trace = trace
        self.env = env or {}
        """Variables the static reader takes as set (``--env``): the values the run will have."""
        self.job_findings = job_findings
        self.hardware = hardware or detect_hardware(split_tool_tokens(passthrough)[1], env={DETECT_ENV: "0"})
        self.overlay = Overlay()

    def script(self, path: Path, *, named: bool = True) -> ScriptAudit:
        """Read and audit every launch in one script; an unreadable script is reported, not raised.

        A Slurm job script is judged against its own allocation (``#SBATCH`` lines, its ``sbatch`` options)
        and its Ray bring-up is linted; ``hardware.*`` arguments after ``--`` still win. A script with no verl
        PPO launch is skipped, with what it runs instead.
        """
        try:
            launches = read_script(path, env=seeded_env(self.env))
            header = self._use_verl_of(path, launches)
            job = read_job_script(path)
            if job.is_job:
                launches = read_script(path, env=seeded_env({**job.allocation.slurm_env(), **self.env}))
            if self.trace is not None:
                launches = self._traced(path, launches)
            if not job.is_job:
                return ScriptAudit(str(path), tuple(self.launch(launch) for launch in launches), verl=header)
            hardware = merge_profiles(self.hardware, job.allocation.profile())
            audits = tuple(self.launch(launch, hardware, job) for launch in launches)
            return ScriptAudit(str(path), audits, verl=header)
        except NoLaunch as exc:
            return ScriptAudit(str(path), skipped=skip_reason(exc.text), named=named)
        except VslError as exc:
            return ScriptAudit(str(path), error=exc, named=named)

    def _use_verl_of(self, path: Path, launches: tuple[ScriptLaunch, ...]) -> tuple[str, ...]:
        """Read the verl this script's launches import (a vendored copy, when it has one); the header for it."""
        before = verl_package_dir()
        exports = [(e.name, e.value) for e in launches[0].exports] if launches else []
        use_project_verl(path, exports)
        if verl_package_dir() != before:
            self.overlay = Overlay()
        return tuple(header_lines())

    def _traced(self, path: Path, static: tuple[ScriptLaunch, ...]) -> tuple[ScriptLaunch, ...]:
        """The launches bash really ran (``--trace``), cited with the lines of the statically read ones."""
        assert self.trace is not None
        args = tuple(token.text for token in self.passthrough)
        trace = trace_script(path, self.trace.env, self.trace.timeout, args)
        print(f"{path}: {trace.containment}", file=sys.stderr)
        launches = traced_launches(str(path), trace.calls, static, self.passthrough)
        if not launches:
            raise InputError(
                f"{path} ran no 'python -m verl.trainer.main_ppo' under --trace (bash exited {trace.returncode})",
                where=trace.stderr.strip().splitlines()[-1] if trace.stderr.strip() else None,
                fix="pass the variables it needs with --env K=V, or audit it without --trace",
            )
        return launches

    def launch(
        self, launch: ScriptLaunch, hardware: HardwareProfile | None = None, job: JobScript | None = None
    ) -> LaunchAudit:
        """Compose one launch (the script's overrides, then the passthrough arguments) and pre-flight it.

        A launch with possible worlds (branches the script does not decide) is judged in each of them.
        """
        if launch.worlds:
            audits = [self.launch(world, hardware, job) for world in launch.worlds]
            readings = [Reading(a.findings, a.unread, a.launch.branch) for a in audits]
            settle = self._settle(launch, ())
            findings, unread = across_worlds(readings, settle)
            return LaunchAudit(launch, tuple(findings), unread, settle if unread else None)
        passthrough = self.passthrough if launch.passthrough and self.trace is None else ()
        try:
            composed = self.overlay.compose(launch.request(passthrough))
        except ConfigError as exc:
            if not exc.what.startswith(GROUP_REFUSED):
                raise
            return LaunchAudit(launch, (_group_refused(launch, exc),))
        view, read = composed.view.recording()  # which values the checks read: what an unread part can decide
        composed = replace(composed, view=view)
        pre = run_preflight(composed, hardware or self.hardware)
        findings = [*pre.findings, *script_findings(launch), *self._unread_values(launch, passthrough)]
        if job is not None and self.job_findings is not None:
            findings += self.job_findings(job, composed.view)
        if self.passthrough and launch.passthrough is None and self.trace is None:
            findings.append(_unused_passthrough(launch))
        everywhere = _Everywhere(self.overlay, launch, passthrough)
        qualified = qualify(findings, launch, everywhere)
        texts = [t.text for t in launch.request(passthrough).overrides]
        exports = [(e.name, e.value) for e in launch.exports]
        qualified = group_older_keys(qualified, texts, verl_release(), launch.path, exports)
        parts = deciding_parts(launch, qualified, read)
        return LaunchAudit(
            launch, tuple(qualified), len(parts), self._settle(launch, parts) if parts else None
        )

    def _settle(self, launch: ScriptLaunch, parts: list[ScriptNote] | tuple[()]) -> str | None:
        """The command that reads what this launch left unread (with the arguments given after ``--``)."""
        return settle_command(launch, parts, tuple(token.text for token in self.passthrough))

    def _unread_values(self, launch: ScriptLaunch, passthrough: tuple[OverrideToken, ...]) -> list[Finding]:
        """``key=$X`` whose value is not read: its key is still one Hydra refuses or not, whatever the value."""
        written: dict[tuple[int | None, str], str] = {}
        probes: list[OverrideToken] = []
        for note in launch.notes:
            if note.kind != "unresolved" or not note.supplies or len(note.supplies) != 1:
                continue
            if note.supplies[0].split(".")[0] in config_groups() or "/" in note.supplies[0]:
                continue  # a config-group choice: its value decides which keys exist
            prefix = note.raw.strip("'\"")[
                : len(note.raw.strip("'\"")) - len(note.raw.strip("'\"").lstrip("+"))
            ]
            source = Source(Layer.SCRIPT, launch.path, note.line, raw=note.raw)
            probes.append(OverrideToken(f"{prefix}{note.supplies[0]}=null", source))
            shown = note.raw.strip("'\"")
            key = note.supplies[0]
            written[(note.line, note.raw)] = (
                shown if shown.lstrip("+").startswith(f"{key}=") else f"{key}=..."
            )
        if not probes:
            return []
        base = launch.request(passthrough)
        return refused_whatever_the_value(
            self.overlay.compose(replace(base, overrides=(*base.overrides, *probes))), written
        )


class _Everywhere:
    """Whether a refused override stays refused under every model engine an unread word could choose."""

    def __init__(
        self, overlay: Overlay, launch: ScriptLaunch, passthrough: tuple[OverrideToken, ...]
    ) -> None:
        self.overlay, self.launch, self.passthrough = overlay, launch, passthrough
        self.found: list[set[tuple[str, tuple[str, ...]]]] | None = None

    def __call__(self, finding: Finding) -> bool:
        if self.found is None:
            self.found = [self._refusals(engine) for engine in model_engines()]
        return all((finding.rule_id, finding.keys) in found for found in self.found)

    def _refusals(self, engine: str) -> set[tuple[str, tuple[str, ...]]]:
        choice = OverrideToken(f"model_engine={engine}", Source(Layer.SCRIPT, self.launch.path))
        base = self.launch.request(self.passthrough)
        request = replace(base, overrides=(*base.overrides, choice))
        findings = audit(self.overlay.compose(request))
        return {(f.rule_id, f.keys) for f in findings if f.severity is Severity.ERROR}


GROUP_REFUSED = "cannot compose verl's config"


def _group_refused(launch: ScriptLaunch, exc: ConfigError) -> Finding:
    """A config-group choice the verl in use does not have (``model_engine=megatron`` on 0.7): Hydra refuses the
    launch before verl starts, a NO-GO of this launch, not an unreadable script."""
    group = re.search(r"Could not find '([^/']+)/", exc.what)
    key = group.group(1) if group else "--config-name"
    message = (
        f"{exc.what.removeprefix(GROUP_REFUSED + ': ')}: {verl_release().name}'s Hydra refuses the launch"
    )
    token = next((t for t in launch.tokens if t.text.partition("=")[0].lstrip("+~") == key), None)
    source = token.source if token is not None else Source(Layer.SCRIPT, launch.path, launch.line)
    value = token.text.partition("=")[2] if token is not None else None
    return Finding("unknown-key", Severity.ERROR, (key,), message, exc.fix, ((key, value, source),))


def _unused_passthrough(launch: ScriptLaunch) -> Finding:
    message = f"{launch.label} does not pass the script's arguments to verl (no \"$@\"), so the arguments after '--' never reach it"
    source = Source(Layer.SCRIPT, launch.path, launch.line)
    fix = 'append "$@" to the launch command, or edit the script'
    return Finding("script-passthrough", Severity.WARNING, ("$@",), message, fix, (("$@", None, source),))


__all__ = ["Auditor", "JobLint", "LaunchAudit", "ScriptAudit", "TraceOptions"]

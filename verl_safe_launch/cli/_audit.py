"""``audit``: audit raw bash launch scripts without running them; findings cite the script's lines."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from verl_safe_launch.audit import Reading, across_worlds, audit, deciding_parts, qualify, script_findings
from verl_safe_launch.cli._common import add_format_arg, add_verbose_arg, make_parser, parse, print_json
from verl_safe_launch.compose import Overlay, model_engines
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, EXIT_USAGE, InputError, UsageError, VslError
from verl_safe_launch.findings import Finding, Severity, has_errors
from verl_safe_launch.inputs import (
    DETECT_ENV,
    HardwareProfile,
    OverrideToken,
    cli_tokens,
    detect_hardware,
    merge_profiles,
    split_tool_tokens,
    verl_package_dir,
)
from verl_safe_launch.launch import bringup_findings
from verl_safe_launch.preflight import header_lines, run_preflight, use_vendored_verl
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.render import (
    counts,
    escape,
    findings_json,
    json_document,
    render_error,
    render_report,
    summary_line,
    verdict,
)
from verl_safe_launch.shell import (
    MAX_TIMEOUT_S,
    JobScript,
    ScriptLaunch,
    check_timeout,
    read_job_script,
    read_script,
    seeded_env,
    trace_script,
    traced_launches,
)

EXAMPLES = """\
  verl-safe-launch audit run_qwen2-7b_grpo.sh
  verl-safe-launch audit examples/*.sh --format json
  verl-safe-launch audit run_qwen2-7b_grpo.sh -- trainer.nnodes=2 actor_rollout_ref.rollout.n=8
  verl-safe-launch audit --trace --env ENGINE=megatron run_qwen2-7b_grpo.sh

Arguments after '--' are audited as the script's own arguments ("$@").
A finding that a part of the script the reader could not read might change is reported as "cannot verify",
and the launch as UNVERIFIED (parts not read) instead of GO.
exit status: 0 go or unverified (clean or warnings only), 1 no-go (errors in any launch; with --strict also
unverified launches and warnings), 2 a script could not be read.
"""


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


class Auditor:
    """Audits scripts one after another, sharing verl's composed defaults between them."""

    def __init__(
        self,
        passthrough: tuple[OverrideToken, ...] = (),
        hardware: HardwareProfile | None = None,
        trace: TraceOptions | None = None,
    ) -> None:
        self.passthrough = passthrough
        self.trace = trace
        self.hardware = hardware or detect_hardware(split_tool_tokens(passthrough)[1], env={DETECT_ENV: "0"})
        self.overlay = Overlay()

    def script(self, path: Path) -> ScriptAudit:
        """Read and audit every launch in one script; an unreadable script is reported, not raised.

        A Slurm job script is judged against its own allocation (``#SBATCH`` lines, its ``sbatch`` options)
        and its Ray bring-up is linted; ``hardware.*`` arguments after ``--`` still win.
        """
        try:
            launches = read_script(path)
            header = self._use_verl_of(path, launches)
            job = read_job_script(path)
            if job.is_job:
                launches = read_script(path, env=seeded_env(job.allocation.slurm_env()))
            if self.trace is not None:
                launches = self._traced(path, launches)
            if not job.is_job:
                return ScriptAudit(str(path), tuple(self.launch(launch) for launch in launches), verl=header)
            hardware = merge_profiles(self.hardware, job.allocation.profile())
            audits = tuple(self.launch(launch, hardware, job) for launch in launches)
            return ScriptAudit(str(path), audits, verl=header)
        except VslError as exc:
            return ScriptAudit(str(path), error=exc)

    def _use_verl_of(self, path: Path, launches: tuple[ScriptLaunch, ...]) -> tuple[str, ...]:
        """Read the verl this script's launches import (a vendored copy, when it has one); the header for it."""
        before = verl_package_dir()
        exports = [(e.name, e.value) for e in launches[0].exports] if launches else []
        use_vendored_verl(path, exports)
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
            findings, unread = across_worlds(readings)
            return LaunchAudit(launch, tuple(findings), unread)
        passthrough = self.passthrough if launch.passthrough and self.trace is None else ()
        composed = self.overlay.compose(launch.request(passthrough))
        view, read = composed.view.recording()  # which values the checks read: what an unread part can decide
        composed = replace(composed, view=view)
        pre = run_preflight(composed, hardware or self.hardware)
        findings = [*pre.findings, *script_findings(launch)]
        if job is not None:
            findings += bringup_findings(job, composed.view)
        if self.passthrough and launch.passthrough is None and self.trace is None:
            findings.append(_unused_passthrough(launch))
        everywhere = _Everywhere(self.overlay, launch, passthrough)
        qualified = qualify(findings, launch, everywhere)
        return LaunchAudit(launch, tuple(qualified), len(deciding_parts(launch, qualified, read)))


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


def _unused_passthrough(launch: ScriptLaunch) -> Finding:
    message = f"{launch.label} does not pass the script's arguments to verl (no \"$@\"), so the arguments after '--' never reach it"
    source = Source(Layer.SCRIPT, launch.path, launch.line)
    fix = 'append "$@" to the launch command, or edit the script'
    return Finding("script-passthrough", Severity.WARNING, ("$@",), message, fix, (("$@", None, source),))


def main(args: Sequence[str], offset: int) -> int:
    """Run ``audit``."""
    parser = make_parser(
        "audit", "Audit raw bash launch scripts (python -m verl.trainer.main_ppo ...).", EXAMPLES
    )
    parser.add_argument("scripts", nargs="+", metavar="SCRIPT", help="bash launch scripts")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 also when a launch is unverified (parts not read) or has warnings",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="EXECUTE the script under bash (in an empty temporary directory, with an empty environment plus "
        "--env; python, python3, torchrun, uv, ray and srun are replaced by recorders) and audit the "
        "command lines it really ran; contained where the machine allows (docs/concepts/hostile-input.md)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="with --trace: an environment variable for the script (repeatable)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help=f"with --trace: seconds (up to {MAX_TIMEOUT_S:g}) before the script and all it started are stopped",
    )
    add_format_arg(parser)
    add_verbose_arg(parser)
    own, extra, extra_at = _split_passthrough(args)
    ns = parse(parser, own)
    positions = [offset + extra_at + i + 1 for i in range(len(extra))]
    trace = TraceOptions(_env(ns.env), check_timeout(ns.timeout)) if ns.trace else None
    auditor = Auditor(cli_tokens(extra, positions), trace=trace)
    results = [auditor.script(Path(p)) for p in ns.scripts]
    if ns.format == "json":
        print_json(audit_json(results))
    else:
        print(render_audit_text(results, verbose=ns.verbose), end="")
    return _exit_code(results, strict=ns.strict)


def _env(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise UsageError(f"--env {item}: expected NAME=VALUE", "--env", "e.g. --env ENGINE=megatron")
        env[key] = value
    return env


def _split_passthrough(args: Sequence[str]) -> tuple[list[str], list[str], int]:
    """Arguments before ``--`` (the verb's own), after it (the scripts' ``"$@"``), and where those start."""
    if "--" not in args:
        return list(args), [], len(args)
    cut = list(args).index("--")
    return list(args[:cut]), list(args[cut + 1 :]), cut + 1


def _exit_code(results: list[ScriptAudit], *, strict: bool = False) -> int:
    if any(r.error is not None for r in results):
        return EXIT_USAGE
    launches = [launch for r in results for launch in r.launches]
    findings = [f for launch in launches for f in launch.findings]
    if has_errors(findings):
        return EXIT_PREFLIGHT
    if strict and (
        any(launch.unread for launch in launches) or any(f.severity is Severity.WARNING for f in findings)
    ):
        return EXIT_PREFLIGHT
    return EXIT_OK


def render_audit_text(results: list[ScriptAudit], *, verbose: bool = True) -> str:
    """Per script and launch: a header, the findings, the verdict; then the total when there are several."""
    blocks: list[str] = []
    everything: list[Finding] = []
    for result in results:
        if result.error is not None:
            blocks.append(f"== {escape(result.path)}\n{render_error(result.error)}\n")
        if result.verl and result.verl != (results[0].verl if result is not results[0] else ()):
            blocks.append("\n".join(escape(line) for line in result.verl))
        for item in result.launches:
            launch = item.launch
            header = f"== {escape(launch.label)}: launch {launch.index} of {len(result.launches)}, {len(launch.tokens)} overrides"
            blocks.append(f"{header}\n{render_report(item.findings, item.unread, verbose=verbose)}")
            everything.extend(item.findings)
    if sum(len(r.launches) for r in results) > 1:
        unread = sum(item.unread for r in results for item in r.launches)
        blocks.append(f"== all launches: {summary_line(everything, unread)}\n")
    return "\n".join(blocks)


def audit_json(results: list[ScriptAudit]) -> dict[str, object]:
    """The stable JSON report of an audit (docs/concepts/findings.md): the verdict, then each script."""
    everything = [f for r in results for launch in r.launches for f in launch.findings]
    unread = sum(item.unread for r in results for item in r.launches)
    fields = {"scripts": [_script_json(r) for r in results]}
    unreadable = any(r.error is not None for r in results)
    return json_document(fields, everything, list_findings=False, unread=unread, unreadable=unreadable)


def _script_json(result: ScriptAudit) -> dict[str, object]:
    return {
        "path": result.path,
        "error": result.error.render() if result.error is not None else None,
        "verl": list(result.verl),
        "launches": [
            {
                "line": item.launch.line,
                "index": item.launch.index,
                "verdict": item.verdict,
                "unread": item.unread,
                "summary": counts(item.findings),
                "overrides": [{"text": t.text, "line": t.source.line} for t in item.launch.tokens],
                "findings": findings_json(item.findings),
            }
            for item in result.launches
        ],
    }

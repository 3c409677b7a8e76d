"""``audit``: audit raw bash launch scripts without running them; findings cite the script's lines."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from verl_safe_launch.backends import bringup_findings
from verl_safe_launch.cli._common import add_format_arg, add_verbose_arg, make_parser, parse, print_json
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, EXIT_USAGE, UsageError
from verl_safe_launch.findings import Severity, has_errors
from verl_safe_launch.inputs import cli_tokens
from verl_safe_launch.preflight import Auditor, ScriptAudit, TraceOptions
from verl_safe_launch.render import audit_json, render_audit_text
from verl_safe_launch.shell import MAX_TIMEOUT_S, check_timeout

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
    auditor = Auditor(cli_tokens(extra, positions), trace=trace, job_findings=bringup_findings)
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

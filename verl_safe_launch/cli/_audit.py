"""``audit``: audit raw bash launch scripts (files, or folders walked) without running them; findings cite the
script's lines; text, JSON, SARIF or JUnit, with a baseline of accepted findings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from verl_safe_launch.backends import bringup_findings
from verl_safe_launch.cli._common import Parser, add_verbose_arg, make_parser, parse, print_json
from verl_safe_launch.errors import EXIT_OK, EXIT_PREFLIGHT, EXIT_USAGE, UsageError
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import cli_tokens
from verl_safe_launch.preflight import (
    Auditor,
    Baseline,
    BaselineWriter,
    Found,
    ScriptAudit,
    TraceOptions,
    find_scripts,
    rule_catalog,
)
from verl_safe_launch.render import (
    AuditText,
    JunitWriter,
    SarifWriter,
    Totals,
    all_launches,
    audit_json,
    render_summary,
)
from verl_safe_launch.shell import MAX_TIMEOUT_S, check_timeout

EXAMPLES = """\
  verl-safe-launch audit run_qwen2-7b_grpo.sh
  verl-safe-launch audit examples/ recipes/ --exclude 'legacy/*'
  verl-safe-launch audit . --format sarif > audit.sarif
  verl-safe-launch audit . --write-baseline vsl-baseline.json   # accept today's findings
  verl-safe-launch audit . --baseline vsl-baseline.json         # only new findings fail
  verl-safe-launch audit run_qwen2-7b_grpo.sh -- trainer.nnodes=2 actor_rollout_ref.rollout.n=8
  verl-safe-launch audit --env EXTRA="$EXTRA" run_qwen2-7b_grpo.sh
  verl-safe-launch audit --trace --env ENGINE=megatron run_qwen2-7b_grpo.sh

A folder is walked in order: .sh, .bash, .sbatch and .slurm files and files whose #! names a shell, except what
a .gitignore or --exclude leaves out; a symlink is never followed out of the folder. Scripts with no verl PPO
launch (SFT, generation, data preparation) are listed as skipped. Arguments after '--' are audited as the
scripts' own arguments ("$@"). A finding that a part of a script the reader could not read might change is
"cannot verify", and the launch UNVERIFIED, with the audit command that reads it.
exit status: 0 go or unverified; 1 no-go: errors in any launch, or a script found in a folder that could not be
read (with --fail-on also unverified launches, or warnings); 2 an unusable command line (a bad option, a path
that does not exist, a named script that cannot be read).
"""
FORMATS = ("text", "json", "sarif", "junit")
FAIL_ON = ("error", "unverified", "warning")


def main(args: Sequence[str], offset: int) -> int:
    """Run ``audit``."""
    own, extra, extra_at = _split_passthrough(args)
    ns = parse(_parser(), own)
    positions = [offset + extra_at + i + 1 for i in range(len(extra))]
    env = _env(ns.env)
    trace = TraceOptions(env, check_timeout(ns.timeout)) if ns.trace else None
    fail_on = "warning" if ns.strict else ns.fail_on
    baseline = Baseline.load(Path(ns.baseline)) if ns.baseline else None
    writer = BaselineWriter() if ns.write_baseline else None
    if ns.write_baseline and Path(ns.write_baseline).exists() and not ns.force:
        raise UsageError(
            f"{ns.write_baseline} exists", where="--write-baseline", fix="pass --force to replace it"
        )
    found = list(find_scripts(ns.paths, ns.exclude))
    auditor = Auditor(cli_tokens(extra, positions), trace=trace, job_findings=bringup_findings, env=env)
    totals = Totals()
    results = _audited(auditor, found, baseline, writer, totals)
    walked = any(Path(p).is_dir() for p in ns.paths) or len(found) > 1
    code = _report(ns, results, totals, baseline, walked=walked, fail_on=fail_on)
    if writer is not None:
        count = writer.write(Path(ns.write_baseline), force=ns.force)
        print(f"wrote {count} baseline entries to {ns.write_baseline}", file=sys.stderr)
        return EXIT_USAGE if code == EXIT_USAGE else EXIT_OK
    return code


def _parser() -> Parser:
    parser = make_parser(
        "audit", "Audit raw bash launch scripts (python -m verl.trainer.main_ppo ...).", EXAMPLES
    )
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", help="launch scripts, Slurm job scripts, or folders"
    )
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="leave out what matches"
    )
    parser.add_argument(
        "--format", choices=FORMATS, default="text", help="output format (sarif, junit for CI)"
    )
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON,
        default="error",
        help="exit 1 from this level: NO-GO launches (error), also UNVERIFIED ones, or also warnings",
    )
    parser.add_argument("--strict", action="store_true", help="the same as --fail-on warning")
    parser.add_argument(
        "--baseline", metavar="FILE", help="findings FILE accepts do not fail; stale ones are listed"
    )
    parser.add_argument("--write-baseline", metavar="FILE", help="record today's errors and warnings in FILE")
    parser.add_argument(
        "--force", action="store_true", help="with --write-baseline: replace an existing FILE"
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
        help="a variable the script reads from its environment, as the run will have it (repeatable); "
        "read by the static reader, and set for the script under --trace",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help=f"with --trace: seconds (up to {MAX_TIMEOUT_S:g}) before the script and all it started are stopped",
    )
    add_verbose_arg(parser)
    return parser


def _audited(
    auditor: Auditor,
    found: list[Found],
    baseline: Baseline | None,
    writer: BaselineWriter | None,
    totals: Totals,
) -> Iterator[ScriptAudit]:
    """Each script's audit in turn (a progress line on a terminal), the baseline applied, the totals counted."""
    progress = sys.stderr.isatty() and len(found) > 1
    for number, item in enumerate(found, 1):
        if progress:
            print(
                f"\r\033[Kauditing {number}/{len(found)}: {item.path}"[:200],
                end="",
                file=sys.stderr,
                flush=True,
            )
        if item.skip is not None:
            result = ScriptAudit(item.path, skipped=item.skip, named=False)
        else:
            result = auditor.script(Path(item.path), named=item.named)
        if writer is not None:
            writer.add(result)
        if baseline is not None:
            result = baseline.apply(result)
        totals.add(result)
        yield result
    if progress:
        print("\r\033[K", end="", file=sys.stderr, flush=True)


def _report(
    ns: argparse.Namespace,
    results: Iterator[ScriptAudit],
    totals: Totals,
    baseline: Baseline | None,
    *,
    walked: bool,
    fail_on: str,
) -> int:
    fmt, verbose = ns.format, ns.verbose
    outcome = _Outcome(fail_on)
    if fmt == "json":
        listed = [outcome.add(r) for r in results]
        document = audit_json(listed)
        if baseline is not None:
            document["baseline"] = {
                "stale": [
                    dict(zip(("rule", "script", "key", "value"), k, strict=True)) for k in baseline.stale()
                ]
            }
        print_json(document)
    elif fmt == "sarif":
        from importlib.metadata import version

        sarif = SarifWriter(
            sys.stdout, rule_catalog(), version("verl-safe-launch"), baseline=baseline is not None
        )
        sarif.start()
        for result in results:
            sarif.script(outcome.add(result))
        sarif.end(outcome.code())
    elif fmt == "junit":
        junit = JunitWriter(sys.stdout, fail_on=fail_on)
        junit.start()
        for result in results:
            junit.script(outcome.add(result))
        junit.end()
    else:
        _text(results, outcome, totals, baseline, walked=walked, verbose=verbose)
    return outcome.code()


def _text(
    results: Iterator[ScriptAudit],
    outcome: _Outcome,
    totals: Totals,
    baseline: Baseline | None,
    *,
    walked: bool,
    verbose: bool,
) -> None:
    text = AuditText(verbose=verbose)
    last: ScriptAudit | None = None
    for result in results:
        block = text.script(outcome.add(result))
        if block:
            print(("\n" if last is not None else "") + block, end="", flush=True)
        last = result
    stale = baseline.stale() if baseline is not None else []
    if walked:
        print("\n" + render_summary(totals, stale), end="")
    elif last is not None and len(last.launches) > 1:
        print("\n" + all_launches([last]), end="")
    elif stale:
        print("\n" + render_summary(Totals(), stale), end="")


class _Outcome:
    """The exit code, from each script as it goes by (nothing kept but what decides it)."""

    def __init__(self, fail_on: str) -> None:
        self.fail_on = fail_on
        self.unusable = self.no_go = self.unverified = self.warned = False

    def add(self, result: ScriptAudit) -> ScriptAudit:
        self.unusable |= result.error is not None and result.named
        self.no_go |= result.error is not None  # a gate never passes a script it could not read
        for launch in result.launches:
            self.no_go |= launch.verdict == "no-go"
            self.unverified |= launch.verdict == "unverified"
            self.warned |= any(f.severity is Severity.WARNING for f in launch.findings)
        return result

    def code(self) -> int:
        if self.unusable:
            return EXIT_USAGE
        if self.no_go:
            return EXIT_PREFLIGHT
        if self.fail_on in ("unverified", "warning") and self.unverified:
            return EXIT_PREFLIGHT
        if self.fail_on == "warning" and self.warned:
            return EXIT_PREFLIGHT
        return EXIT_OK


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

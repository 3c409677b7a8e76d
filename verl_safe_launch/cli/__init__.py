"""Command-line entry point: ``verl-safe-launch [VERB] [OPTIONS] [OVERRIDE ...]``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from verl_safe_launch.errors import EXIT_USAGE, UsageError, VslError

# verb -> (module inside verl_safe_launch.cli, one-line summary); the DESIGN.md contract.
VERBS: dict[str, tuple[str, str]] = {
    "run": ("_run", "pre-flight, then launch verl on Ray (default verb)"),
    "check": ("_check", "pre-flight only: audit + validate + estimate"),
    "show": ("_show", "resolved config as YAML; --origin adds where each value came from"),
    "explain": ("_explain", "the batch arithmetic, step by step"),
    "estimate": ("_estimate", "per-stage GPU memory; --fit finds the largest safe micro batches"),
    "audit": ("_audit", "audit raw bash launch scripts"),
    "migrate": ("_migrate", "turn a raw script into a YAML file + a verl-safe-launch command"),
    "slurm": ("_slurm", "write (and optionally submit) a Slurm job"),
    "presets": ("_presets", "list the presets, or show one with its values"),
    "upgrade": ("_upgrade", "rewrite a launch written for an older verl release for the installed one"),
    "submit": ("_submit", "pre-flight, then submit the run to an existing Ray cluster's job API"),
    "kuberay": ("_kuberay", "write a KubeRay RayJob that runs the pre-flighted launch on Kubernetes"),
    "oom": ("_oom", "read a failed run's log: the stage that ran out and the fixes, ranked by memory freed"),
}
DEFAULT_VERB = "run"


def _usage() -> str:
    lines = ["usage: verl-safe-launch [VERB] [OPTIONS] [OVERRIDE ...]", "", "verbs:"]
    lines += [f"  {verb:<9} {summary}" for verb, (_, summary) in VERBS.items()]
    lines += ["", "Run 'verl-safe-launch VERB --help' for the options and examples of one verb."]
    return "\n".join(lines)


def split_verb(argv: Sequence[str]) -> tuple[str, list[str], int]:
    """Return (verb, remaining args, argv offset of the first remaining arg)."""
    if argv and argv[0] in VERBS:
        return argv[0], list(argv[1:]), 1
    if argv and not argv[0].startswith("-") and "=" not in argv[0] and argv[0][:1] not in "~+":
        raise UsageError(
            f"unknown verb '{argv[0]}'",
            where="command line, argument 1",
            fix="use one of: " + ", ".join(VERBS) + " (or pass overrides directly to run)",
        )
    return DEFAULT_VERB, list(argv), 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb and return its exit code; user errors print compactly (VSL_FULL_ERROR=1: traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"], []):
        print(_usage())
        return 0 if args else EXIT_USAGE
    try:
        verb, rest, offset = split_verb(args)
        module_name, _ = VERBS[verb]
        try:
            module = importlib.import_module(f"verl_safe_launch.cli.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"verl_safe_launch.cli.{module_name}":
                raise
            raise UsageError(f"verb '{verb}' is not available in this version") from None
        code: int = module.main(rest, offset)
        return code
    except VslError as exc:
        if os.environ.get("VSL_FULL_ERROR") == "1":
            raise
        print(exc.render(), file=sys.stderr)
        return exc.exit_code


def console_main() -> None:
    """Console-script entry point."""
    sys.exit(main())

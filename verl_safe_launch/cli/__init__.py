"""Command-line entry point: ``verl-safe-launch [VERB] [OPTIONS] [OVERRIDE ...]``."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import traceback
from collections.abc import Sequence

from verl_safe_launch.environment import missing_dependency
from verl_safe_launch.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    VslError,
)
from verl_safe_launch.secret import forget, redact

# verb -> (module inside verl_safe_launch.cli, one-line summary); the DESIGN.md contract.
VERBS: dict[str, tuple[str, str]] = {
    "run": ("_run", "pre-flight, then launch verl on Ray (default verb)"),
    "check": ("_check", "pre-flight only: audit + validate + estimate"),
    "show": ("_show", "resolved config as YAML; --origin adds where each value came from"),
    "explain": ("_explain", "the batch arithmetic, step by step; or one rule: explain RULE"),
    "estimate": ("_estimate", "per-stage GPU memory; --fit finds the largest safe micro batches"),
    "audit": ("_audit", "audit raw bash launch scripts"),
    "migrate": ("_migrate", "turn a raw script into a YAML file + a verl-safe-launch command"),
    "slurm": ("_slurm", "write (and optionally submit) a Slurm job"),
    "presets": ("_presets", "list the presets, or show one with its values"),
    "upgrade": ("_upgrade", "rewrite a launch written for an older verl release for the installed one"),
    "submit": ("_submit", "pre-flight, then submit the run to an existing Ray cluster's job API"),
    "kuberay": ("_kuberay", "write a KubeRay RayJob that runs the pre-flighted launch on Kubernetes"),
    "rules": ("_rules", "every rule the tool reports: id, severity, since which verl, what it checks"),
    "oom": ("_oom", "read a failed run's log: the stage that ran out and the fixes, ranked by memory freed"),
}
DEFAULT_VERB = "run"


def _usage() -> str:
    lines = ["usage: verl-safe-launch [VERB] [OPTIONS] [OVERRIDE ...]", "", "verbs:"]
    lines += [f"  {verb:<9} {summary}" for verb, (_, summary) in VERBS.items()]
    lines += [
        "",
        "Every verb takes --verl DIR: check against the verl package in DIR (or DIR/verl), not the installed one.",
    ]
    lines += ["Run 'verl-safe-launch VERB --help' for the options and examples of one verb."]
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
    """Run one verb and return its exit code.

    User errors print compactly (exit 2); an unexpected exception prints one line (exit 4); Ctrl-C exits 130;
    a closed pipe ends quietly. ``VSL_FULL_ERROR=1`` adds the traceback and never changes the exit code.
    """
    try:
        _tolerant_streams()
        forget()  # secrets an earlier command in this process met in its inputs
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except VslError as exc:
        from verl_safe_launch.render import render_error

        return _report(render_error(exc), exc.exit_code)
    except KeyboardInterrupt:
        return _report("interrupted (Ctrl-C)", EXIT_INTERRUPTED, traceback_too=False)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except Exception as exc:
        module = exc.name.split(".")[0] if isinstance(exc, ModuleNotFoundError) and exc.name else None
        if module is not None and module != "verl_safe_launch":
            error = missing_dependency([module])
            return _report(error.render(), error.exit_code)
        from verl_safe_launch.render import escape

        what = escape(f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__)
        return _report(
            f"internal error: {what} (a bug in verl-safe-launch; VSL_FULL_ERROR=1 for the traceback)",
            EXIT_INTERNAL,
        )


def _dispatch(args: list[str]) -> int:
    if args in (["-h"], ["--help"], []):
        print(_usage())
        return 0 if args else EXIT_USAGE
    args = _take_verl_option(args)
    verb, rest, offset = split_verb(args)
    module_name, _ = VERBS[verb]
    try:
        module = importlib.import_module(f"verl_safe_launch.cli.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"verl_safe_launch.cli.{module_name}":
            raise
        raise UsageError(f"verb '{verb}' is not available in this version") from None
    from verl_safe_launch.render import guarded_output  # the verb has imported it: no cost

    with guarded_output():
        code: int = module.main(rest, offset)
    return code


def _take_verl_option(args: list[str]) -> list[str]:
    """Remove ``--verl DIR`` (any verb) and make that copy of verl the one every check reads."""
    from pathlib import Path

    from verl_safe_launch.inputs import choose_verl

    choose_verl(None, scope="project")  # each command chooses afresh (main() may run several in one process)
    choose_verl(None)
    for index, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--verl" or arg.startswith("--verl="):
            value = (
                arg.partition("=")[2] if "=" in arg else (args[index + 1] if index + 1 < len(args) else "")
            )
            if not value:
                raise UsageError(
                    "--verl needs a directory", where="command line", fix="--verl path/to/project"
                )
            choose_verl(Path(value).expanduser(), "--verl")
            return args[:index] + args[index + (1 if "=" in arg else 2) :]
    return args


def _report(text: str, code: int, *, traceback_too: bool = True) -> int:
    """Print one compact message (and, with VSL_FULL_ERROR=1, the traceback first); return ``code``."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        _silence_stdout()
    if traceback_too and os.environ.get("VSL_FULL_ERROR") == "1":
        traceback.print_exc()
    with contextlib.suppress(BrokenPipeError, ValueError):
        print(redact(text), file=sys.stderr)
    return code


def _tolerant_streams() -> None:
    """Never crash on output the terminal's encoding cannot show (PYTHONIOENCODING=ascii): escape it."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


def _silence_stdout() -> None:
    """After the reader of stdout went away (``| head``): send the rest nowhere, so exit does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def console_main() -> None:
    """Console-script entry point; a second Ctrl-C while the first is reported still exits 130, quietly."""
    try:
        code = main()
    except KeyboardInterrupt:  # before main's own handler was in place, or while it reported the first
        code = _report("interrupted (Ctrl-C)", EXIT_INTERRUPTED, traceback_too=False)
    deadline = sys.modules.get("verl_safe_launch.launch.deadline")  # loaded only by verbs that wait on Ray
    abandoned = getattr(deadline, "ABANDONED", [])
    if any(thread.is_alive() for thread in abandoned):  # a native call still running: skip the teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

"""Shared pieces of the verbs: an argparse parser that raises UsageError, and compose from arguments."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from verl_safe_launch.compose import Composed, ComposeRequest
from verl_safe_launch.errors import UsageError
from verl_safe_launch.overrides import cli_tokens
from verl_safe_launch.presets import compose_for_launch


class Parser(argparse.ArgumentParser):
    """argparse that reports problems as a compact UsageError (exit 2) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, where=f"command line ({self.prog})", fix=f"see '{self.prog} --help'")


def make_parser(verb: str, description: str, examples: str) -> Parser:
    """A parser for one verb, with its examples shown by --help."""
    return Parser(
        prog=f"verl-safe-launch {verb}",
        description=description,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_compose_args(parser: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    """-c/--config FILE (repeatable), --format, and the override list."""
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="FILE.yaml",
        help="a user YAML layer (partial verl config, nested or dotted keys); repeatable, applied in order",
    )
    add_format_arg(parser)
    if overrides:
        parser.add_argument(
            "overrides",
            nargs="*",
            metavar="OVERRIDE",
            help="Hydra overrides (key=value, +key=value, ++key=value, ~key, model_engine=megatron), "
            "plus preset=NAME and hardware.* tokens",
        )


def add_format_arg(parser: argparse.ArgumentParser) -> None:
    """--format text|json."""
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")


def parse(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace:
    """Parse with options and overrides intermixed."""
    return parser.parse_intermixed_args(list(args))


def override_positions(args: Sequence[str], overrides: Sequence[str], offset: int) -> list[int]:
    """1-based argv positions of the overrides (the verb, when given, is argument 1)."""
    positions: list[int] = []
    start = 0
    for text in overrides:
        index = list(args).index(text, start)
        positions.append(index + 1 + offset)
        start = index + 1
    return positions


def compose_from_args(ns: argparse.Namespace, args: Sequence[str], offset: int) -> Composed:
    """Compose verl's config from parsed arguments, with argv positions for provenance.

    Hardware facts fill the GPU counts nobody set; a preset is adapted to the hardware (``--fit``, where a
    verb has it, lets its micro batches grow past the preset's values).
    """
    overrides = list(getattr(ns, "overrides", []) or [])
    tokens = cli_tokens(overrides, override_positions(args, overrides, offset))
    request = ComposeRequest(overrides=tokens, config_files=tuple(Path(p) for p in ns.config))
    return compose_for_launch(request, fit=bool(getattr(ns, "fit", False)))


def print_json(data: Any) -> None:
    """Deterministic JSON on stdout."""
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")

"""Shared pieces of the verbs: an argparse parser that raises UsageError, and compose from arguments (for the
launch, or for a declared allocation)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from verl_safe_launch.backends import compose_allocation
from verl_safe_launch.compose import Composed, require_accepted
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import (
    ComposeRequest,
    HardwareProfile,
    OverrideToken,
    request_from_args,
)
from verl_safe_launch.preflight import use_project_verl
from verl_safe_launch.presets import compose_for_launch
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.render import json_text
from verl_safe_launch.shell import choose_config


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


def add_config_name_args(parser: argparse.ArgumentParser) -> None:
    """``--config-name`` and ``--config-path``, read as a launch's are (verl's own config by name by default)."""
    parser.add_argument(
        "--config-name",
        metavar="NAME",
        help="compose this config as the launch's --config-name does: one of verl's own (ppo_megatron_trainer in "
        "0.5 to 0.7), or NAME.yaml in --config-path laid over the verl config its defaults name",
    )
    parser.add_argument(
        "--config-path",
        metavar="DIR",
        help="the directory of --config-name (default: verl's own config directory)",
    )


def with_config_name(ns: argparse.Namespace, request: ComposeRequest) -> ComposeRequest:
    """The request with the config ``--config-name``/``--config-path`` choose; one that cannot be read is refused."""
    name, path = getattr(ns, "config_name", None), getattr(ns, "config_path", None)
    if name is None and path is None:
        return request
    if path is not None and Path(path).expanduser().is_dir():
        path = str(Path(path).expanduser().resolve())
    choice = choose_config(name, path, None)
    for kind, detail, unread in choice.notes:
        if unread or kind == "config-missing":
            raise UsageError(detail, where="--config-name/--config-path", fix="name a config that exists")
    files = (*choice.files, *request.config_files)
    return replace(request, config_name=choice.config_name, config_files=files, named_configs=choice.files)


def add_verbose_arg(parser: argparse.ArgumentParser) -> None:
    """``--verbose``: list every info note instead of one summary line of them."""
    parser.add_argument(
        "--verbose", action="store_true", help="list every info note (by default they are one summary line)"
    )


def add_format_arg(parser: argparse.ArgumentParser) -> None:
    """--format text|json."""
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")


def parse(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace:
    """Parse with options and overrides intermixed."""
    return parser.parse_intermixed_args(list(args))


def compose_from_args(ns: argparse.Namespace, args: Sequence[str], offset: int) -> Composed:
    """Compose verl's config from parsed arguments, with argv positions for provenance.

    Hardware facts fill the GPU counts nobody set; a preset is adapted to the hardware (``--fit``, where a
    verb has it, lets its micro batches grow past the preset's values). Every override Hydra refuses is
    reported at once.
    """
    request = with_config_name(ns, request_from_args(ns, args, offset))
    return require_accepted(compose_for_launch(request, fit=bool(getattr(ns, "fit", False))))


def compose_for_allocation(
    ns: argparse.Namespace, args: Sequence[str], offset: int, verb: str
) -> tuple[Composed, HardwareProfile]:
    """Compose for the declared allocation only: nothing is read from the machine this runs on. The config must
    use all of it (the job ``verb`` writes asks for exactly that)."""
    overrides = list(ns.overrides)
    for text in overrides:
        if text.split("=", 1)[0] in ("hardware.nodes", "hardware.gpus_per_node"):
            raise UsageError(
                f"'{text}': the allocation is given with --nodes and --gpus-per-node",
                where="command line",
                fix="drop it and pass --nodes / --gpus-per-node",
            )
    hardware = [
        _option_token(args, offset, flag, f"hardware.{name}={value}")
        for flag, name, value in (
            ("--nodes", "nodes", ns.nodes),
            ("--gpus-per-node", "gpus_per_node", ns.gpus_per_node),
        )
    ]
    return compose_allocation(with_config_name(ns, request_from_args(ns, args, offset)), hardware, verb)


def _option_token(args: Sequence[str], offset: int, flag: str, text: str) -> OverrideToken:
    index = next((i for i, a in enumerate(args) if a == flag or a.startswith(flag + "=")), None)
    position = None if index is None else index + 1 + offset
    value = text.split("=", 1)[1]
    raw = f"{flag} {value}" if index is not None else f"{flag} {value}, the default"
    return OverrideToken(text, Source(Layer.CLI, arg_index=position, raw=raw))


def use_verl_of_project(ns: argparse.Namespace) -> None:
    """Check against the verl the project uses: the project of the first ``-c`` file, else of the working
    directory (a copy vendored there or above, its pin), unless ``--verl`` names one."""
    files = getattr(ns, "config", None) or []
    use_project_verl(Path(files[0]) if files else None)


def print_json(data: Any) -> None:
    """Deterministic, strict JSON on stdout (see ``render.json_document`` for the shape)."""
    sys.stdout.write(json_text(data))

"""``presets``: list the presets with their intended hardware and model scale, or show one preset's values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_safe_launch.cli._common import add_format_arg, make_parser, parse, print_json
from verl_safe_launch.compose import available_presets
from verl_safe_launch.config_view import ConfigView, format_value
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import (
    ComposeRequest,
    ToolSettings,
    cli_tokens,
    detect_hardware,
    load_architecture,
)
from verl_safe_launch.presets import AUTO, PRESETS, PresetInfo, choose_auto, compose_for_launch, preset_values
from verl_safe_launch.provenance import Layer
from verl_safe_launch.render import Column, escape, json_document, render_table

EXAMPLES = """\
  verl-safe-launch presets
  verl-safe-launch presets medium
  verl-safe-launch presets auto
  verl-safe-launch presets cluster --format json
  verl-safe-launch presets medium hardware.gpus_per_node=6 hardware.gpu_memory_gb=80
  verl-safe-launch presets auto hardware.gpus_per_node=2 actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct
"""

ADAPTS = (
    "On other hardware the values you did not set adapt, each with its reason (presets NAME hardware.*=..., show\n"
    "--origin, check): GPU counts from the hardware; train and mini batch sizes to the nearest sizes that divide\n"
    "evenly; Ulysses to a divisor of the GPUs; rollout memory fraction and TP, then optimizer / parameter offload,\n"
    "then FSDP2's CPU offload, until every stage fits with the actor's state resident during rollout; micro\n"
    "batches to divisors of their batch and to what fits, never above the preset's value unless --fit is given."
)


def main(args: Sequence[str], offset: int) -> int:
    """Run ``presets``."""
    parser = make_parser("presets", "List the presets, or show one preset's values.", EXAMPLES)
    parser.add_argument("name", nargs="?", metavar="NAME", help="the preset to show")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="hardware.* tokens (and e.g. the model path): show the values adapted to that hardware",
    )
    add_format_arg(parser)
    ns = parse(parser, args)
    if ns.name is None:
        _list(ns.format)
        return 0
    if ns.name not in available_presets():
        raise UsageError(
            f"unknown preset '{ns.name}'",
            where=f"command line, argument {offset + 1 + list(args).index(ns.name)}",
            fix="use one of: " + ", ".join(available_presets()),
        )
    if ns.overrides:
        positions = [offset + 1 + list(args).index(text) for text in ns.overrides]
        _show_adapted(ns.name, ns.overrides, positions, ns.format)
        return 0
    _show(ns.name, ns.format)
    return 0


def _show_adapted(name: str, overrides: list[str], positions: list[int], fmt: str) -> None:
    """The preset composed for the declared hardware: every preset value, adapted ones with their reasons."""
    tokens = cli_tokens([f"preset={name}", *overrides], [0, *positions])
    composed = compose_for_launch(ComposeRequest(overrides=tokens))
    view = composed.view
    chosen = name
    rows: list[tuple[str, Any, str | None]] = []
    for key, prov in view.provenance.items():
        layers = [prov.source.layer, *(w.source.layer for w in prov.history)]
        if Layer.PRESET not in layers and Layer.ADAPTED not in layers:
            continue
        if prov.source.layer is Layer.PRESET and prov.source.name:
            chosen = prov.source.name
        reason = prov.source.reason if prov.source.layer is Layer.ADAPTED else None
        rows.append((key, prov.value, reason))
    if fmt == "json":
        data = {
            "name": name,
            "preset": chosen,
            "values": {key: value for key, value, _ in rows},
            "adapted": {key: reason for key, _, reason in rows if reason},
            "sized_for": sized_for(view),
        }
        print_json(data)
        return
    auto = f" (auto chose {chosen})" if name == AUTO else ""
    print(f"preset {name}{auto} adapted to: {' '.join(overrides)}")
    print(f"  sized for: {sized_for(view)}")
    width = max((len(key) for key, _, _ in rows), default=0)
    for key, value, reason in rows:
        print(f"  {key:<{width}} = {escape(format_value(value))}")
        if reason:
            print(f"  {'':<{width}}   adapted: {escape(reason)}")


MODEL_KEY = "actor_rollout_ref.model.path"


def sized_for(view: ConfigView) -> str:
    """The model the adaptation sized for: its path, size and where the path came from."""
    path, prov = view.get(MODEL_KEY), view.prov(MODEL_KEY)
    arch = load_architecture(path if isinstance(path, str) else None)
    size = (
        f"{arch.params / 1e9:.1f}B parameters"
        if arch
        else "no architecture known: sizes are not adapted to it"
    )
    if prov is not None and prov.source.layer is Layer.VERL:
        return f"{MODEL_KEY}={path} ({size}), verl's placeholder default: pass {MODEL_KEY}=... for your model"
    return f"{MODEL_KEY}={path} ({size})"


def _info(name: str) -> PresetInfo:
    return PRESETS.get(name, PresetInfo(name, "-", "-", "a preset file in conf/preset"))


def _list(fmt: str) -> None:
    infos = [_info(name) for name in _ordered(available_presets())]
    if fmt == "json":
        print_json(json_document({"presets": [_info_json(info) for info in infos]}))
        return
    columns = [Column("NAME"), Column("HARDWARE"), Column("MODELS"), Column("SUMMARY")]
    print(render_table(columns, [(i.name, i.hardware, i.models, i.summary) for i in infos]), end="")
    print("\nUse one with preset=NAME; 'verl-safe-launch presets NAME' shows its values.")


def _ordered(names: list[str]) -> list[str]:
    known = [name for name in PRESETS if name in names]
    return known + [name for name in names if name not in PRESETS]


def _info_json(info: PresetInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "hardware": info.hardware,
        "models": info.models,
        "summary": info.summary,
        "file": f"conf/preset/{info.name}.yaml",
    }


def _show(name: str, fmt: str) -> None:
    info = _info(name)
    values = [] if name == AUTO else preset_values(name)
    choice = _auto_choice() if name == AUTO else None
    if fmt == "json":
        data = _info_json(info)
        data["values"] = {key: value for key, value, _ in values}
        if name == AUTO:
            data["choice"] = {"preset": choice[0], "why": choice[1]} if choice else None
        print_json(json_document(data))
        return
    if name == AUTO:
        print(f"preset auto: {info.summary} (conf/preset/auto.yaml)")
    else:
        print(f"preset {escape(name)}: {info.hardware}; models {info.models} (conf/preset/{name}.yaml)")
    width = max((len(key) for key, _, _ in values), default=0)
    for key, value, _ in values:
        print(f"  {key:<{width}} = {escape(format_value(value))}")
    if name == AUTO:
        print(
            f"  here: {choice[0]}, {choice[1]}" if choice else "  here: hardware unknown (declare hardware.*)"
        )
    print("\n" + ADAPTS)


def _auto_choice() -> tuple[str, str] | None:
    profile = detect_hardware(ToolSettings())
    if profile.gpus_per_node is None:
        return None
    return choose_auto(profile, None)

"""The adaptation in progress: the changes made so far to the keys a preset owns, with their reasons."""

from __future__ import annotations

from typing import Any

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import Architecture
from verl_safe_launch.inputs import HardwareProfile, load_architecture
from verl_safe_launch.provenance import Layer, Source, Write
from verl_safe_launch.rules import batch_plan, pos_int, with_values


class Adaptation:
    """The changes made so far to the keys a preset owns (keys nobody else set), with their reasons."""

    def __init__(
        self, view: ConfigView, name: str, profile: HardwareProfile, arch: Architecture | None
    ) -> None:
        self.base = view
        self.name = name
        self.profile = profile
        self.arch = arch
        self.changes: dict[str, tuple[Any, str]] = {}
        self.view = view

    def owned(self, key: str) -> bool:
        prov = self.base.prov(key)
        return prov is not None and prov.source.layer is Layer.PRESET

    def free(self, key: str) -> bool:
        """Nobody chose the value: it is the preset's or verl's default (a memory knob may move it)."""
        prov = self.base.prov(key)
        return prov is not None and prov.source.layer in (Layer.PRESET, Layer.VERL)

    def value(self, key: str) -> int | None:
        return pos_int(self.view.get(key))

    def change(self, key: str, value: Any, reason: str, *, knob: bool = False) -> None:
        allowed = self.free(key) if knob else self.owned(key)
        if allowed and value != self.view.get(key):
            self.changes[key] = (value, reason)
            self.view = with_values(self.base, {k: v for k, (v, _) in self.changes.items()})

    @property
    def gpus(self) -> int | None:
        return batch_plan(self.view).gpus

    def writes(self) -> tuple[Write, ...]:
        return tuple(
            Write(key, value, Source(Layer.ADAPTED, reason=f"preset {self.name}: {reason}"))
            for key, (value, reason) in self.changes.items()
        )


def heads_clause(arch: Architecture | None) -> str:
    if arch is None:
        return ""
    return f" and the heads ({arch.num_attention_heads} attention, {arch.num_key_value_heads} KV)"


def critic_arch(state: Adaptation) -> Architecture | None:
    return load_architecture(state.view.get("critic.model.path"))

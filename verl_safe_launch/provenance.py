"""Where every value came from, as frozen data recorded when the value is written."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum


class Layer(StrEnum):
    """Composition layers, lowest precedence first."""

    VERL = "verl"
    PRESET = "preset"
    ADAPTED = "adapted"
    FILE = "file"
    SCRIPT = "script"
    CLI = "cli"
    HARDWARE = "hardware"


LAYER_TITLES = {
    Layer.VERL: "verl default",
    Layer.PRESET: "preset",
    Layer.ADAPTED: "preset adapted to hardware",
    Layer.FILE: "user file",
    Layer.SCRIPT: "script",
    Layer.CLI: "command line",
    Layer.HARDWARE: "hardware",
}


@dataclass(frozen=True)
class Source:
    """One origin: a YAML file and line, a command-line argument, a script line, or a derived reason."""

    layer: Layer
    file: str | None = None
    line: int | None = None
    arg_index: int | None = None
    raw: str | None = None
    reason: str | None = None
    name: str | None = None

    def describe(self) -> str:
        """Human-readable origin, e.g. ``command line, argument 4 (data.train_batch_size=60)``."""
        title = LAYER_TITLES[self.layer]
        if self.name:
            title = f"{title} {self.name}"
        parts = [title]
        if self.file:
            parts.append(f"{self.file}:{self.line}" if self.line else self.file)
        if self.arg_index is not None:
            parts.append(f"argument {self.arg_index}")
        text = ", ".join(parts)
        if self.raw and self.layer in (Layer.CLI, Layer.SCRIPT):
            text += f" ({self.raw})"
        if self.reason:
            text += f": {self.reason}"
        return text

    def to_json(self) -> dict[str, object]:
        """JSON form, omitting empty fields."""
        data: dict[str, object] = {"layer": self.layer.value}
        for key in ("file", "line", "arg_index", "raw", "reason", "name"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        return data


@dataclass(frozen=True)
class Write:
    """One attempt to set a key: the raw value as written and where it was written."""

    key: str
    value: object
    source: Source
    delete: bool = False


@dataclass(frozen=True)
class Provenance:
    """A leaf's final value, its source, the earlier writes it replaced, and what it interpolates."""

    key: str
    value: object
    source: Source
    history: tuple[Write, ...] = field(default=())
    interpolation: str | None = None
    follows: str | None = None

    @property
    def explicit(self) -> bool:
        """True when the final value was written by anything other than verl's defaults."""
        return self.source.layer is not Layer.VERL

    def to_json(self) -> dict[str, object]:
        """JSON form of the provenance of one leaf."""
        data: dict[str, object] = {"key": self.key, "value": self.value, "source": self.source.to_json()}
        if self.interpolation is not None:
            data["interpolation"] = self.interpolation
            data["follows"] = self.follows
        data["history"] = [{"value": w.value, "source": w.source.to_json()} for w in self.history]
        return data


def writes_by_key(writes: Iterable[Write]) -> dict[str, list[Write]]:
    """The writes of each key, in the order they were made (keys in order of their first write)."""
    by_key: dict[str, list[Write]] = {}
    for write in writes:
        by_key.setdefault(write.key, []).append(write)
    return by_key

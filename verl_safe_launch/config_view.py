"""A read-only, flattened view of the composed config: dotted key → resolved value and provenance."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.provenance import Layer, Provenance

ARR = "actor_rollout_ref"
"""verl's node for the actor, the rollout and the reference model."""

MISSING = "???"


@dataclass(frozen=True)
class ConfigView:
    """Resolved leaf values with their provenance; the input of every stage after composition."""

    values: Mapping[str, Any]
    provenance: Mapping[str, Provenance]

    def get(self, key: str, default: Any = None) -> Any:
        """The resolved value of a leaf, or ``default`` when the key does not exist."""
        return self.values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def keys(self) -> Iterator[str]:
        """All leaf keys in config order."""
        return iter(self.values)

    def prov(self, key: str) -> Provenance | None:
        """The provenance of a leaf, if it exists."""
        return self.provenance.get(key)

    def explicit(self, key: str) -> bool:
        """True when anything other than verl's defaults set this leaf."""
        prov = self.provenance.get(key)
        return prov is not None and prov.explicit

    def subtree(self, prefix: str) -> dict[str, Any]:
        """Leaves at or below ``prefix`` (a dotted key), in config order."""
        dotted = prefix + "."
        return {k: self.values[k] for k in self.values if k == prefix or k.startswith(dotted)}

    def recording(self) -> tuple[ConfigView, set[str]]:
        """This view, and the set that collects every key whose value is read through it (see ``ReadLog``)."""
        log = ReadLog(self.values)
        return ConfigView(log, self.provenance), log.read

    def nested(self, prefix: str = "") -> Any:
        """The subtree below ``prefix`` as nested plain dicts (the whole config for an empty prefix)."""
        items = self.subtree(prefix) if prefix else dict(self.values)
        if prefix in items:
            return items[prefix]
        cut = len(prefix) + 1 if prefix else 0
        return nest((key[cut:], value) for key, value in items.items())


class ReadLog(Mapping[str, Any]):
    """A view's values that remember every key whose value was read: what the checks of a launch depend on.

    Listing the keys, or asking whether one exists, reads no value (which keys exist is decided by composition, not
    by a value); ``get``, ``[key]``, ``items()`` and ``values()`` do.
    """

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def nest(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Nested plain dicts from ``(dotted key, value)`` pairs; a later pair wins over an earlier one."""
    out: dict[str, Any] = {}
    for key, value in items:
        *parents, leaf = key.split(".")
        target = out
        for part in parents:
            child = target.get(part)
            if not isinstance(child, dict):
                child = target[part] = {}
            target = child
        target[leaf] = value
    return out


def is_missing(value: Any) -> bool:
    """True for Hydra's mandatory-missing marker ``???``."""
    return isinstance(value, str) and value == MISSING


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into dotted leaves; lists and empty mappings are leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def ref_in_actor(view: ConfigView) -> bool:
    """With LoRA the reference is the actor without its adapter: no reference worker, no ref micro batch.

    verl decides this in its trainers (``ref_in_actor = lora_rank > 0 or lora_adapter_path is not None``).
    """
    lora = view.get(f"{ARR}.model.lora.rank")
    rank = lora if isinstance(lora, int) and lora > 0 else view.get(f"{ARR}.model.lora_rank")
    return (isinstance(rank, int) and rank > 0) or view.get(f"{ARR}.model.lora_adapter_path") is not None


def layer_of(view: ConfigView, key: str) -> Layer | None:
    """The layer that set the final value of ``key``."""
    prov = view.provenance.get(key)
    return prov.source.layer if prov else None


def format_value(value: Any) -> str:
    """A value as a user writes it in YAML or an override: ``null``, ``true``, ``8``, ``["a", "b"]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)

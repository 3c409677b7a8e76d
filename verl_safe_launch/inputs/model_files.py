"""What verl loads from a local model directory besides config.json: a tokenizer and the weights.

The file names are transformers' own (each tokenizer class's ``vocab_files_names``, the weight and index names in
``transformers.utils``), generated into ``data/model_files.json``; a test regenerates it and compares.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from verl_safe_launch.errors import VslError
from verl_safe_launch.files import MAX_INPUT_BYTES, read_input

DATA_FILE = "model_files.json"
NOT_A_TOKENIZER = frozenset({"tokenizer_config.json"})
"""Listed by some tokenizer classes, but a tokenizer's settings, not its vocabulary."""


@dataclass(frozen=True)
class ModelFiles:
    """The names transformers loads a tokenizer and a model's weights from."""

    tokenizer: tuple[str, ...]
    weights: tuple[str, ...]
    indexes: tuple[str, ...]


def generate_model_files() -> dict[str, Any]:
    """The names, read from the installed transformers (imports it)."""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    names: set[str] = set()
    unread: set[str] = set()
    for classes in TOKENIZER_MAPPING_NAMES.values():
        for name in (classes,) if isinstance(classes, str) else tuple(classes or ()):
            try:
                cls = getattr(transformers, name, None) if name else None
                names.update(getattr(cls, "vocab_files_names", {}).values())
            except ImportError:  # a class whose backend (sentencepiece, ...) is not installed here
                unread.add(name)
    return {
        "transformers": transformers.__version__,
        "unread_tokenizer_classes": sorted(unread),
        "tokenizer": sorted(names - NOT_A_TOKENIZER),
        "weights": [SAFE_WEIGHTS_NAME, WEIGHTS_NAME],
        "indexes": [SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME],
    }


@functools.cache
def model_files() -> ModelFiles:
    """The shipped names (``data/model_files.json``)."""
    data = json.loads(
        resources.files("verl_safe_launch.data").joinpath(DATA_FILE).read_text(encoding="utf-8")
    )
    return ModelFiles(tuple(data["tokenizer"]), tuple(data["weights"]), tuple(data["indexes"]))


def missing_model_files(directory: Path) -> list[str]:
    """What a local model directory lacks of what verl loads from it (empty when nothing is missing)."""
    names = model_files()
    missing: list[str] = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any((directory / name).is_file() for name in names.tokenizer):
        missing.append(f"tokenizer ({', '.join(_first(names.tokenizer))}, ...)")
    missing.extend(_weights(directory, names))
    return missing


def _first(names: tuple[str, ...]) -> list[str]:
    common = ("tokenizer.json", "tokenizer.model", "vocab.json")
    return [n for n in common if n in names] or list(names[:3])


def _weights(directory: Path, names: ModelFiles) -> list[str]:
    """Nothing when a weight file is there, or an index whose every shard is; else what is missing."""
    if any((directory / name).is_file() for name in names.weights):
        return []
    for index in names.indexes:
        path = directory / index
        if path.is_file():
            shards = _shards(path)
            if shards is None:
                return [f"a readable {index} (its weight_map names the shards)"]
            absent = sorted(s for s in shards if not (directory / s).is_file())
            return (
                [f"the shards {index} lists: {', '.join(absent[:3])}" + (" ..." if len(absent) > 3 else "")]
                if absent
                else []
            )
    return [f"weights ({', '.join((*names.weights, *names.indexes))})"]


def _shards(index: Path) -> set[str] | None:
    try:
        data = json.loads(read_input(index, limit=MAX_INPUT_BYTES))
    except (OSError, ValueError, VslError):
        return None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        return None
    return {
        str(v)
        for v in weight_map.values()
        if isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
    }


__all__ = ["ModelFiles", "generate_model_files", "missing_model_files", "model_files"]

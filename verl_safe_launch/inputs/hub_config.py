"""A hub config.json that leaves values to its config class's defaults, read as transformers reads it.

``save_pretrained`` writes only the values that differ from the class defaults, so a shipped config can lack the
heads, the vocabulary or whether the head is tied (Gemma-3's text_config lists four numbers). Such a config is
completed by transformers' own config class, offline, once per config (cached on disk by its digest).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Mapping
from typing import Any

from verl_safe_launch.inputs.knowledge import cached_json

READ_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)
"""What the pre-flight reads from a config: a config lacking one of them relies on its class's default."""


def text_part(data: Mapping[str, Any]) -> dict[str, Any]:
    """The config with a nested ``text_config`` merged over it (vision-language models)."""
    nested = data.get("text_config")
    return {**data, **(nested if isinstance(nested, dict) else {})}


def relies_on_defaults(data: Mapping[str, Any]) -> bool:
    """The config leaves a value the pre-flight reads to its config class."""
    merged = text_part(data)
    return any(key not in merged for key in READ_KEYS)


def with_defaults(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config with every default its transformers config class fills (None when transformers does not know
    its model_type or is not installed)."""
    if not isinstance(data.get("model_type"), str):
        return None
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    text = json.dumps(data, sort_keys=True, default=str)
    key = hashlib.sha256(f"{version}:{text}".encode()).hexdigest()[:20]
    try:
        value, _ = cached_json(f"configs/{data['model_type']}-{key}.json", lambda: _complete(data))
    except (ImportError, KeyError, ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, dict) else None


def _complete(data: Mapping[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    values = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
    completed = AutoConfig.for_model(str(data["model_type"]), **values).to_dict()
    plain: dict[str, Any] = json.loads(json.dumps(completed, default=str))
    return plain

"""Model architecture numbers from config.json: a local dir, the Hugging Face cache, or a bundled table."""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from verl_safe_launch.context import Architecture


def from_config_dict(data: dict[str, Any], name: str, source: str) -> Architecture:
    """Build an Architecture from a config.json mapping (text-config nested under ``text_config`` too)."""
    if "hidden_size" not in data and isinstance(data.get("text_config"), dict):
        data = {**data, **data["text_config"]}
    heads = int(data["num_attention_heads"])
    hidden = int(data["hidden_size"])
    return Architecture(
        name=name,
        source=source,
        hidden_size=hidden,
        num_hidden_layers=int(data["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        intermediate_size=int(data.get("intermediate_size") or 4 * hidden),
        vocab_size=int(data["vocab_size"]),
        max_position_embeddings=int(data.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        head_dim=int(data.get("head_dim") or hidden // heads),
        model_type=str(data.get("model_type", "")),
        num_experts=int(data.get("num_experts") or data.get("n_routed_experts") or 0),
        num_experts_per_tok=int(data.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(data.get("moe_intermediate_size") or 0),
        attention_bias=bool(data.get("attention_bias", False)),
    )


@functools.cache
def bundled_table() -> dict[str, dict[str, Any]]:
    """The bundled architecture table keyed by Hugging Face repo id (verified config.json numbers)."""
    text = resources.files("verl_safe_launch.data").joinpath("architectures.json").read_text(encoding="utf-8")
    table: dict[str, dict[str, Any]] = json.loads(text)
    return {k: v for k, v in table.items() if not k.startswith("_")}


def hf_cache_dirs() -> list[Path]:
    """Candidate Hugging Face hub cache directories (read only)."""
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]))
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    dirs.append(home / "hub")
    return dirs


def _from_hf_cache(repo_id: str) -> Path | None:
    folder = "models--" + repo_id.replace("/", "--")
    for cache in hf_cache_dirs():
        snapshots = cache / folder / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
                if (snap / "config.json").is_file():
                    return snap / "config.json"
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_architecture(model_path: str | None) -> Architecture | None:
    """Architecture of ``model_path``: local dir, then HF cache, then the bundled table; None if unknown."""
    if not model_path:
        return None
    expanded = Path(os.path.expanduser(str(model_path)))
    candidates: list[tuple[Path | None, str]] = [
        (expanded / "config.json", f"{expanded}/config.json"),
        (_from_hf_cache(str(model_path)), f"Hugging Face cache ({model_path})"),
    ]
    for path, label in candidates:
        if path is not None and path.is_file():
            data = _read_json(path)
            if data is not None and "hidden_size" in {**data, **data.get("text_config", {})}:
                return from_config_dict(data, str(model_path), label)
    return _from_table(str(model_path))


def local_architectures(model_path: str | None) -> list[object] | None:
    """The ``architectures`` entry of a local model directory's config.json (``[]`` when it has none), else None."""
    if not model_path:
        return None
    path = Path(os.path.expanduser(str(model_path))) / "config.json"
    data = _read_json(path) if path.is_file() else None
    if data is None:
        return None
    found = data.get("architectures")
    return list(found) if isinstance(found, list) else []


def _from_table(model_path: str) -> Architecture | None:
    table = bundled_table()
    key = model_path if model_path in table else _table_key(model_path, table)
    if key is None:
        return None
    return from_config_dict(table[key], key, f"bundled table ({key})")


def _table_key(model_path: str, table: dict[str, dict[str, Any]]) -> str | None:
    """Match a local path whose last component is a known model name (e.g. ~/models/Qwen2.5-7B-Instruct)."""
    tail = Path(model_path.rstrip("/")).name.lower()
    for key in table:
        if key.split("/")[-1].lower() == tail:
            return key
    return None

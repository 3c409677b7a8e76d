"""Model architecture numbers from config.json: a local dir, the Hugging Face cache, or a bundled table."""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from verl_safe_launch.context import Architecture, RopeScaling, VisionTower
from verl_safe_launch.errors import InputError
from verl_safe_launch.files import MAX_INPUT_BYTES, read_input
from verl_safe_launch.inputs.hub_config import relies_on_defaults, text_part, with_defaults


def from_config_dict(data: dict[str, Any], name: str, source: str) -> Architecture:
    """Build an Architecture from a config.json mapping (text-config nested under ``text_config`` too); a
    config that relies on its class's defaults is completed by transformers' config class first."""
    raw = data
    if relies_on_defaults(data):
        data = with_defaults(data) or data
    text = text_part(data)
    vision = _vision_tower(data.get("vision_config"), text)
    if "hidden_size" not in data and isinstance(data.get("text_config"), dict):
        data = text
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
        attention_bias=bool(data.get("attention_bias", False)),
        final_logit_softcapping=float(data.get("final_logit_softcapping") or 0.0),
        sliding_window=_sliding_window(data),
        vision=vision,
        config_json=json.dumps(raw, sort_keys=True, default=str),
        config_type=str(raw.get("model_type", "")),
        length_keys=tuple((key, value) for key in LENGTH_KEYS if (value := _first_int(data, (key,)))),
        rope_scaling=_rope_scaling(data, _first_int(data, ("original_max_position_embeddings",))),
        **_moe_fields(data),
        **_mla_fields(data),
    )


LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""Keys under which a config.json states a maximum length (the list vLLM derives its max_model_len from)."""


def _rope_scaling(data: dict[str, Any], outer_original: int) -> tuple[RopeScaling, ...]:
    """``rope_scaling`` (or transformers 5's ``rope_parameters``, one entry per layer type when nested).

    A top-level ``original_max_position_embeddings`` wins over the entry's own, as transformers standardizes it.
    """
    found = data.get("rope_scaling") or data.get("rope_parameters")
    if not isinstance(found, dict):
        return ()
    entries = found.values() if all(isinstance(v, dict) for v in found.values()) else [found]
    out: list[RopeScaling] = []
    for entry in entries:
        rope_type = entry.get("rope_type") or entry.get("type") or "default"
        factor = entry.get("factor")
        original = outer_original or entry.get("original_max_position_embeddings")
        out.append(
            RopeScaling(
                str(rope_type),
                float(factor) if isinstance(factor, int | float) and not isinstance(factor, bool) else None,
                original if isinstance(original, int) and not isinstance(original, bool) else None,
            )
        )
    return tuple(out)


MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _mla_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention ranks and head widths (DeepSeek-V2/V3); empty without ``kv_lora_rank``."""
    if not _first_int(data, ("kv_lora_rank",)):
        return {}
    return {key: _first_int(data, (key,)) for key in MLA_KEYS}


def _vision_tower(data: object, text: dict[str, Any]) -> VisionTower | None:
    """The vision encoder of a ``vision_config`` (Qwen2/2.5-VL's ``depth``, a SigLIP or CLIP tower's
    ``num_hidden_layers``); None when absent. Patches per language-model token: the spatial merge (Qwen), the
    pooling to ``mm_tokens_per_image`` (Gemma-3), else one."""
    if not isinstance(data, dict):
        return None
    depth = _first_int(data, ("depth", "num_hidden_layers"))
    hidden = _first_int(data, ("hidden_size", "embed_dim"))
    if not depth or not hidden:
        return None
    patch = _first_int(data, ("patch_size", "spatial_patch_size")) or 14
    merge = _first_int(data, ("spatial_merge_size",))
    per_image = _first_int(text, ("mm_tokens_per_image",))
    side = _first_int(data, ("image_size",)) // patch
    pooled = side * side // per_image if per_image and side * side >= per_image else 1
    return VisionTower(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=_first_int(data, ("intermediate_size",)) or 4 * hidden,
        out_hidden_size=_first_int(data, ("out_hidden_size",))
        or _first_int(text, ("hidden_size",))
        or hidden,
        patch_size=patch,
        temporal_patch_size=_first_int(data, ("temporal_patch_size",)) or (2 if merge else 1),
        spatial_merge_size=merge or 1,
        in_channels=_first_int(data, ("in_channels", "in_chans", "num_channels")) or 3,
        pooling=pooled if not merge else 1,
    )


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


def _first_int(data: dict[str, Any], keys: tuple[str, ...]) -> int:
    for key in keys:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _moe_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Mixture-of-experts numbers under every spelling (Mixtral, Qwen2/3-MoE, DeepSeek); empty for dense."""
    experts = _first_int(data, EXPERT_COUNT_KEYS)
    if not experts:
        return {}
    moe = int(data.get("moe_intermediate_size") or 0)
    shared = int(data.get("shared_expert_intermediate_size") or 0)
    if not shared and data.get("n_shared_experts"):
        shared = int(data["n_shared_experts"]) * (moe or int(data.get("intermediate_size") or 0))
    return {
        "num_experts": experts,
        "num_experts_per_tok": _first_int(data, EXPERTS_PER_TOKEN_KEYS) or 1,
        "moe_intermediate_size": moe,
        "shared_expert_intermediate_size": shared,
        "shared_expert_gate": bool(data.get("shared_expert_intermediate_size")),
        "first_k_dense_layers": int(data.get("first_k_dense_replace") or 0),
    }


def _sliding_window(data: dict[str, Any]) -> int:
    """The attention window in tokens when sliding-window attention is on (0: full attention everywhere)."""
    if data.get("use_sliding_window") is False:
        return 0
    value = data.get("sliding_window")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


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


_FIX = "point actor_rollout_ref.model.path at a model directory with a valid config.json"


def _read_json(path: Path, label: str) -> dict[str, Any]:
    """A model's config.json as a mapping; an InputError when it is not one (verl's model loading would fail)."""
    data = read_input(path, what="model config.json", where=label, limit=4 * MAX_INPUT_BYTES)
    try:
        parsed = json.loads(data)
    except UnicodeDecodeError as exc:
        raise InputError(f"{label} is not UTF-8 text ({exc.reason})", where=label, fix=_FIX) from None
    except ValueError as exc:
        raise InputError(f"{label} is not valid JSON: {exc}", where=label, fix=_FIX) from None
    except RecursionError:
        raise InputError(
            f"{label} is nested too deeply to be a model config", where=label, fix=_FIX
        ) from None
    if not isinstance(parsed, dict):
        raise InputError(f"{label} holds {type(parsed).__name__}, not a JSON object", where=label, fix=_FIX)
    return parsed


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL = (
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
MAX_DIMENSION = 10**9


def _check_dimensions(data: dict[str, Any], label: str) -> None:
    """Every size a memory estimate divides or multiplies by is a whole number in range; else an InputError."""
    nested = data.get("text_config")
    merged = {**data, **(nested if isinstance(nested, dict) else {})}
    for key in (*_REQUIRED, *_OPTIONAL):
        value = merged.get(key)
        if value is None and key in _OPTIONAL:
            continue
        low = 1 if key in _REQUIRED else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_DIMENSION:
            raise InputError(
                f"{label}: {key} is {json.dumps(value)}, not a whole number from {low} to {MAX_DIMENSION:,}",
                where=label,
                fix=_FIX,
            )


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
        if path is not None and os.path.lexists(path):
            data = _read_json(path, label)
            if "hidden_size" in text_part(data):
                _check_dimensions((with_defaults(data) if relies_on_defaults(data) else None) or data, label)
                return from_config_dict(data, str(model_path), label)
    return _from_table(str(model_path))


def local_architectures(model_path: str | None) -> list[object] | None:
    """The ``architectures`` entry of a local model directory's config.json (``[]`` when it has none), else None."""
    if not model_path:
        return None
    path = Path(os.path.expanduser(str(model_path))) / "config.json"
    if not os.path.lexists(path):
        return None
    data = _read_json(path, str(path))
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

"""The load formats of the rollout engines verl 0.9.1 pins, read from their source (``data/engine_formats.json``).

verl passes ``actor_rollout_ref.rollout.load_format`` to the engine that serves the rollout, unchanged: a format
the engine does not know stops the rollout server when it starts (vLLM: ``Load format `x` is not supported``;
SGLang: not a ``LoadFormat``). The shipped file is made by :func:`engine_formats_json` from the engines' own
source (``pip install --no-deps --target DIR vllm==0.24.0 sglang==0.5.12``, the versions verl 0.9.1's ``vllm`` and
``sglang`` extras pin); a slow test installs them and regenerates it.
"""

from __future__ import annotations

import ast
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

VLLM_TABLE = ("vllm/model_executor/model_loader/__init__.py", "_LOAD_FORMAT_TO_MODEL_LOADER")
"""vLLM's loader lookup: ``get_model_loader`` raises for a format that is not a key of this dict."""
SGLANG_ENUM = ("sglang/srt/configs/load_config.py", "LoadFormat")
"""SGLang's ``LoadFormat`` enum: ``LoadConfig`` turns the server's ``load_format`` into one of its members."""


def _dict_keys(tree: ast.Module, name: str) -> list[str]:
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(value, ast.Dict):
            return [k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    raise ValueError(f"no dict {name} in the source")


def _enum_values(tree: ast.Module, name: str) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                item.value.value
                for item in node.body
                if isinstance(item, ast.Assign)
                and isinstance(item.value, ast.Constant)
                and isinstance(item.value.value, str)
            ]
    raise ValueError(f"no class {name} in the source")


def _version(root: Path, project: str) -> str:
    """The version of ``project`` installed with ``pip --target root`` (from its dist-info directory)."""
    found = sorted(root.glob(f"{project}-*.dist-info"))
    if not found:
        raise ValueError(f"no {project} dist-info in {root}")
    return found[-1].name[len(project) + 1 : -len(".dist-info")]


def read_engine_formats(vllm_root: Path, sglang_root: Path) -> dict[str, dict[str, object]]:
    """Engine → its version, the file and name the formats are read from, and the formats (sorted)."""
    vllm_file, table = VLLM_TABLE
    sglang_file, enum = SGLANG_ENUM
    vllm_tree = ast.parse((vllm_root / vllm_file).read_text(encoding="utf-8"))
    sglang_tree = ast.parse((sglang_root / sglang_file).read_text(encoding="utf-8"))
    return {
        "vllm": {
            "version": _version(vllm_root, "vllm"),
            "source": f"{vllm_file}:{table}",
            "load_formats": sorted(_dict_keys(vllm_tree, table)),
        },
        "sglang": {
            "version": _version(sglang_root, "sglang"),
            "source": f"{sglang_file}:{enum}",
            "load_formats": sorted(_enum_values(sglang_tree, enum)),
        },
    }


def engine_formats_json(vllm_root: Path, sglang_root: Path, verl_version: str) -> str:
    """The shipped file's text: the formats of each engine, and the verl release that pins these versions."""
    data = {"pinned_by": f"verl {verl_version}", **read_engine_formats(vllm_root, sglang_root)}
    return json.dumps(data, indent=1) + "\n"


@functools.cache
def engine_formats() -> dict[str, Any]:
    """The shipped file, as JSON: ``pinned_by``, then one entry per engine."""
    text = (
        resources.files("verl_safe_launch.data").joinpath("engine_formats.json").read_text(encoding="utf-8")
    )
    data: dict[str, Any] = json.loads(text)
    return data


def engine_load_formats() -> dict[str, frozenset[str]]:
    """Engine name (``vllm``, ``sglang``, as ``rollout.name`` says it) → the load formats it accepts."""
    out: dict[str, frozenset[str]] = {}
    for name, entry in engine_formats().items():
        formats = entry.get("load_formats") if isinstance(entry, dict) else None
        if isinstance(formats, list):
            out[name] = frozenset(str(f) for f in formats)
    return out


def engine_version(name: str) -> str | None:
    """The version of an engine whose formats are known (``0.24.0``), or None."""
    entry = engine_formats().get(name)
    version = entry.get("version") if isinstance(entry, dict) else None
    return str(version) if version else None


def pinned_by() -> str:
    """``verl 0.9.1``: the release whose extras pin the engine versions the formats were read from."""
    return str(engine_formats().get("pinned_by", ""))

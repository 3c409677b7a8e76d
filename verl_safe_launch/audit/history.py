"""verl's trainer config at each release (key → default), and the key moves between releases derived from it."""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from typing import Any

# Release series → the history file that stands for it (the last tag of the series we have).
RELEASES: dict[str, str] = {
    "0.1": "v0.1",
    "0.2": "v0.2.0.post2",
    "0.3": "v0.3.0.post1",
    "0.4": "v0.4.1",
    "0.5": "v0.5.0",
    "0.6": "v0.6.1",
    "0.7": "v0.7.1",
    "0.8": "v0.8.0",
    "0.9": "v0.9.0",
}
TAGS = (
    "v0.1",
    "v0.2.0.post2",
    "v0.3.0.post1",
    "v0.4.1",
    "v0.5.0",
    "v0.6.0",
    "v0.6.1",
    "v0.7.0",
    "v0.7.1",
    "v0.8.0",
    "v0.9.0",
)
INSTALLED_SERIES = "0.9"


@dataclass(frozen=True)
class Move:
    """A key that moved between two consecutive release tags (derived from the history, or written by hand)."""

    old: str
    new: str
    release: str
    evidence: str


@functools.cache
def history(tag: str) -> dict[str, Any]:
    """Flattened trainer config (key → default) of one release tag."""
    folder = resources.files("verl_safe_launch.data").joinpath("verl_history")
    data: dict[str, Any] = json.loads(folder.joinpath(f"{tag}.json").read_text(encoding="utf-8"))
    return data


def series_of(tag: str) -> str:
    """``v0.6.1`` → ``0.6``; ``v0.1`` → ``0.1``."""
    return ".".join(tag.lstrip("v").split(".")[:2])


def version(release: str) -> tuple[int, ...]:
    """A release as a comparable tuple; a series (``0.7``) stands for the tag that represents it (0.7.1)."""
    text = RELEASES.get(release, release).lstrip("v")
    return tuple(int(part) for part in re.findall(r"\d+", text))


def generate_moves() -> list[Move]:
    """Key moves between consecutive tags: a removed key whose dotted suffix reappears under a new prefix.

    A move is kept only when it is unambiguous (one target for the key under the best prefix pair), the same
    prefix pair moves at least two keys, and either more than the leaf name matches or the default is unchanged.
    """
    moves: list[Move] = []
    for old_tag, new_tag in itertools.pairwise(TAGS):
        before, after = history(old_tag), history(new_tag)
        removed = sorted(set(before) - set(after))
        added = sorted(set(after) - set(before))
        candidates = {key: _candidates(key, added) for key in removed}
        support = Counter(pair for found in candidates.values() for pair in {(p, q) for p, q, _, _ in found})
        for key in removed:
            move = _best(key, candidates[key], support, before, after, new_tag)
            if move is not None:
                moves.append(move)
    return [m for m in moves if _lands(m, moves)]


def _lands(move: Move, moves: list[Move]) -> bool:
    """True when following the later moves from ``move`` ends at a key of the newest release we know."""
    key = move.new
    for later in moves:
        if version(later.release) > version(move.release) and later.old == key:
            key = later.new
    return key in history(TAGS[-1])


def _candidates(key: str, added: list[str]) -> list[tuple[str, str, str, int]]:
    parts = key.split(".")
    found: list[tuple[str, str, str, int]] = []
    for target in added:
        other = target.split(".")
        n = 0
        while n < min(len(parts), len(other)) and parts[-1 - n] == other[-1 - n]:
            n += 1
        if n:
            found.append((".".join(parts[: len(parts) - n]), ".".join(other[: len(other) - n]), target, n))
    return found


def _best(
    key: str,
    found: list[tuple[str, str, str, int]],
    support: Counter[tuple[str, str]],
    before: dict[str, Any],
    after: dict[str, Any],
    tag: str,
) -> Move | None:
    ranked = sorted(
        (f for f in found if support[(f[0], f[1])] >= 2), key=lambda f: (-f[3], -support[(f[0], f[1])])
    )
    if not ranked:
        return None
    top = ranked[0]
    ties = [f for f in ranked if (f[3], support[(f[0], f[1])]) == (top[3], support[(top[0], top[1])])]
    prefix, new_prefix, target, matched = top
    if len(ties) > 1 or (matched == 1 and before[key] != after[target]):
        return None
    evidence = f"'{prefix or '(top level)'}' moved to '{new_prefix}' ({support[(prefix, new_prefix)]} keys)"
    return Move(key, target, tag.lstrip("v"), evidence)


def flatten_release_yaml(text: str) -> dict[str, Any]:
    """A release's ``ppo_trainer.yaml`` as the history stores it: every leaf flattened with dots, its value as YAML
    loads it (interpolations stay strings; an empty mapping is a leaf)."""
    import yaml

    def walk(node: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if isinstance(value, dict) and value:
                out.update(walk(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    data = yaml.safe_load(text)
    return walk(data if isinstance(data, dict) else {}, "")


def history_json(flat: dict[str, Any]) -> str:
    """The flattened config as the JSON file shipped in the package (keys sorted)."""
    return json.dumps(dict(sorted(flat.items())), indent=0) + "\n"


def last_release_with(key: str) -> str | None:
    """The newest release whose trainer config has ``key`` (None: no release in the history had it)."""
    found = [tag.lstrip("v") for tag in TAGS if key in history(tag)]
    return found[-1] if found else None


def moves_json(moves: list[Move]) -> str:
    """The generated table as the JSON file shipped in the package."""
    rows = [{"old": m.old, "new": m.new, "release": m.release, "evidence": m.evidence} for m in moves]
    return json.dumps(rows, indent=1) + "\n"


@functools.cache
def generated_moves() -> tuple[Move, ...]:
    """The shipped table (``data/verl_renames.json``), made by :func:`generate_moves`."""
    text = resources.files("verl_safe_launch.data").joinpath("verl_renames.json").read_text(encoding="utf-8")
    return tuple(Move(**row) for row in json.loads(text))

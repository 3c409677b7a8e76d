"""Did-you-mean for config keys: only a key that means the same thing, never one that is merely spelled alike.

Two ways a key can mean another: the same leaf under a moved section (``actor.megatron.x`` → ``actor.mcore.x``,
one such key only), or a typo of a sibling (``train_bach_size``: each word of the leaf within one or two edits of
the sibling's word in the same place, or the same letters without the underscores). ``max_obs_length`` is not
``max_prompt_length``, ``grad_offload`` is not ``param_offload``, ``torch_dtype`` is not ``lora.dtype``.
"""

from __future__ import annotations

from collections.abc import Iterable


def did_you_mean(key: str, known: Iterable[str]) -> str | None:
    """The known key ``key`` most likely means, if any (see the module's doc)."""
    keys = [k for k in known if k != key and not k.endswith("._target_")]
    typo = typo_of(key, keys)
    if typo is not None:
        return typo
    leaf = key.rpartition(".")[2]
    moved = [k for k in keys if k.rpartition(".")[2] == leaf and _shares_section(key, k)]
    return moved[0] if len(moved) == 1 else None


def typo_of(key: str, known: Iterable[str]) -> str | None:
    """The sibling ``key`` is a slip of the keyboard for (``data.train_bach_size``), if any."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == parent and k != key]
    typos = [k for k in siblings if is_typo(leaf, k.rpartition(".")[2])]
    return min(typos, key=lambda k: _distance(leaf, k.rpartition(".")[2])) if typos else None


def is_typo(wrong: str, right: str) -> bool:
    """``bach`` for ``batch``, ``trainbatch`` for ``train_batch``: a slip, not another word."""
    if wrong == right:
        return False
    if wrong.replace("_", "").lower() == right.replace("_", "").lower():
        return True
    a, b = wrong.split("_"), right.split("_")
    if len(a) != len(b):
        return False
    differing = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    return len(differing) == 1 and all(
        _distance(x, y) <= (2 if min(len(x), len(y)) >= 6 else 1) for x, y in differing
    )


def _shares_section(key: str, other: str) -> bool:
    """Both under the same top-level section (``actor_rollout_ref``, ``critic``...)."""
    return key.split(".", 1)[0] == other.split(".", 1)[0]


def _distance(a: str, b: str) -> int:
    """Edit distance with transpositions (optimal string alignment)."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = 0 if ca == cb else 1
            value = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + cost)
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                value = min(value, rows[-2][j - 2] + 1)
            row.append(value)
        rows.append(row)
    return rows[-1][-1]

"""Nearest valid values and how a fix renders (the pasteable part comes first)."""

from __future__ import annotations

import pytest

from verl_safe_launch.rules import (
    KeyFix,
    divisor_fix,
    divisors,
    first_tokens,
    nearest,
    render_fix,
    search_fix,
)


@pytest.mark.parametrize(("n", "expected"), [(1, [1]), (12, [1, 2, 3, 4, 6, 12]), (49, [1, 7, 49]), (0, [])])
def test_divisors(n: int, expected: list[int]) -> None:
    assert divisors(n) == expected


def test_divisors_of_120_match_the_documented_list() -> None:
    assert divisors(120) == [1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, 30, 40, 60, 120]


@pytest.mark.parametrize(
    ("value", "step", "expected"), [(68, 8, [64, 72]), (60, 8, [56, 64]), (3, 8, [8]), (70, 8, [72, 64])]
)
def test_nearest_multiples(value: int, step: int, expected: list[int]) -> None:
    assert nearest(value, lambda v: v % step == 0) == expected


def test_renders_pasteable_first_then_alternatives() -> None:
    fix = render_fix(
        [
            divisor_fix("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 8, 12),
            search_fix("data.train_batch_size", 68, lambda v: v % 8 == 0),
            None,
        ]
    )
    assert fix == (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6 (valid: 1, 2, 3, 4, 6, 12); "
        "or data.train_batch_size=64 (or 72)"
    )
    assert first_tokens(fix) == ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"]


def test_extra_tokens_and_booleans() -> None:
    fix = KeyFix("critic.ppo_micro_batch_size_per_gpu", (4, 2), extra=("critic.ppo_micro_batch_size=null",))
    assert fix.render() == "critic.ppo_micro_batch_size=null critic.ppo_micro_batch_size_per_gpu=4 (or 2)"
    assert KeyFix("a.use_remove_padding", (True,)).render() == "a.use_remove_padding=true"
    assert render_fix([None]) is None

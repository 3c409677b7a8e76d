"""Interpolation budget: how long counting the cost of the hostile reproducers takes, and composing them.

Usage: python bench/interpolation_budget.py
Prints, for each reproducer (a 16-level doubling, a value of 85,000 references, a 1,990-key chain) and for verl's
own defaults, the time of the budget check alone on the flat values, and the time ``compose()`` takes to refuse
the file (reading the YAML included). Without the budget each of these took over a minute.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_interpolation_budget import chain, doubling, wide

from verl_safe_launch.compose import check_interpolation_budget, compose
from verl_safe_launch.config_view import flatten
from verl_safe_launch.errors import ConfigError
from verl_safe_launch.inputs import ComposeRequest, parse_yaml


def _check_ms(text: str) -> float:
    raw = {leaf.key: leaf.value for leaf in parse_yaml(text, "bench.yaml", expand_dots=True).leaves}
    start = time.perf_counter()
    with contextlib.suppress(ConfigError):
        check_interpolation_budget(raw, lambda key: None)
    return (time.perf_counter() - start) * 1000


def _compose_s(text: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(text)
        start = time.perf_counter()
        with contextlib.suppress(ConfigError):
            compose(ComposeRequest(config_files=(path,)))
        return time.perf_counter() - start


def main() -> None:
    from omegaconf import OmegaConf

    base = compose(ComposeRequest())
    raw = flatten(OmegaConf.to_container(base.cfg, resolve=False))  # type: ignore[arg-type]
    start = time.perf_counter()
    check_interpolation_budget(raw, lambda key: None)
    print(f"verl defaults ({len(raw)} values): budget check {(time.perf_counter() - start) * 1000:.1f} ms")
    for name, text in (
        ("doubling x16", doubling(16)),
        ("wide 85,000", wide(85_000)),
        ("chain 1,990", chain(1_990)),
    ):
        print(
            f"{name:<14} {len(text):>9,} bytes: check {_check_ms(text):7.1f} ms, compose refuses in {_compose_s(text):.2f} s"
        )


if __name__ == "__main__":
    main()

"""Differential run against the installed verl: N generated configs through verl's validate_config and our rules.

Prints: how many configs verl rejects and whether we reject each of them too (misses must be 0), and, for the
configs verl accepts but we reject, which rules caught them (failures verl would only hit after Ray starts).

    .venv/bin/python bench/differential.py [--examples 500] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_tiny_model  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from recompose import recompose  # noqa: E402
from verl_oracle import Tally, configs, our_errors, verl_verdict, with_models  # noqa: E402

from verl_safe_launch.compose import compose  # noqa: E402
from verl_safe_launch.context import HardwareFacts  # noqa: E402
from verl_safe_launch.inputs import ComposeRequest, cli_tokens  # noqa: E402


class Clock:
    """Seconds spent per phase."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def time(self, name: str, start: float) -> None:
        self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start


def run(examples: int, seed_value: int, model: Path) -> tuple[Tally, Clock, list[list[str]]]:
    tally, clock, seen = Tally(), Clock(), []

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(configs())
    def one(overrides: list[str]) -> None:
        full = with_models(overrides, model)
        start = time.perf_counter()
        composed = recompose(full)
        clock.time("compose (once per engine + overrides)", start)
        start = time.perf_counter()
        ours = our_errors(composed, HardwareFacts())
        clock.time("our rules + audit", start)
        start = time.perf_counter()
        verl = verl_verdict(composed.cfg)
        clock.time("verl validate_config", start)
        tally.add(full, verl, ours)
        seen.append(full)

    one()
    return tally, clock, seen


def full_compose_cost(samples: list[list[str]]) -> float:
    """Mean seconds of a full Hydra composition per config, on a few of the generated configs."""
    start = time.perf_counter()
    for overrides in samples:
        compose(ComposeRequest(overrides=cli_tokens(overrides)))
    return (time.perf_counter() - start) / max(1, len(samples))


def report(tally: Tally, clock: Clock, full_cost: float) -> None:
    print(f"configs: {tally.total}")
    print(
        f"verl rejects: {tally.verl_rejects}; we reject {tally.both_reject} of them; misses: {len(tally.misses)}"
    )
    for overrides, reason in tally.misses:
        print(f"  MISS {reason}\n       {' '.join(overrides)}")
    print(f"verl accepts: {tally.total - tally.verl_rejects}; we also accept {tally.both_accept}; "
          f"we reject {tally.early_configs} (late failures caught early)")  # fmt: skip
    print("\nverl's rejections by message:")
    for reason, count in tally.verl_reasons.most_common():
        print(f"  {count:5d}  {reason}")
    print("\nconfigs verl accepts and we reject, by rule (a config can count under several rules):")
    for rule_id, count in tally.early.most_common():
        print(f"  {count:5d}  {rule_id}")
    print("\nmean seconds per config:")
    for name, spent in clock.spent.items():
        print(f"  {spent / max(1, tally.total):.3f}  {name}")
    print(f"  {full_cost:.3f}  full compose() per config, for comparison")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-model")
        tally, clock, seen = run(ns.examples, ns.seed, model)
        report(tally, clock, full_compose_cost(seen[:10]))
    return 1 if tally.misses else 0


if __name__ == "__main__":
    sys.exit(main())

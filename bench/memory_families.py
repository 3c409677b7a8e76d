"""The memory model per family against full-depth traces, the cost of deriving a model's terms from its code, and
the error bands the estimator ships.

The traces are bench/memory_calibration.json's full-depth cases (``calibrate_memory.py --full`` makes them): every
family at its real depth, two shapes (1 × 8192 and 4 × 1024 tokens), log-prob and the update with and without
gradient checkpointing. The estimate is the estimator's own: a calibrated row where the family has one, else the
terms derived from the model's code (one layer of each kind traced at 1,024 tokens and scaled).

    python bench/memory_families.py --derive   # derive each family in a fresh process: its cold cost, stored
    python bench/memory_families.py --bands    # the measured bands -> verl_safe_launch/data/memory_bands.json
    python bench/memory_families.py            # the table of docs/concepts/memory.md (markdown)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from memory_trace import (  # noqa: E402
    CACHE,
    FAMILY_SHAPES,
    FULL_MODELS,
    MODELS,
    MODES,
    Case,
    config_of,
    estimate,
    full_cases,
    grid,
    load_cache,
)

MIB = float(1 << 20)
BANDS = ROOT / "verl_safe_launch" / "data" / "memory_bands.json"
STAGES = {
    ("logprob", False): "log-prob",
    ("update", True): "update, checkpointing",
    ("update", False): "update, no checkpointing",
}
COLD = """
import json, sys, time
start = time.perf_counter()
from verl_safe_launch.memory.derive import derive
terms = derive(json.loads(sys.argv[1]))
terms["seconds_cold"] = round(time.perf_counter() - start, 2)
print(json.dumps(terms))
"""


def error(est: float, ref: float) -> float:
    """Relative error of the estimate (a fraction)."""
    return (est - ref) / ref


def traced(case: Case, data: dict[str, Any]) -> float:
    return float(data["cases"][case.key]["traced_total"])


def case_error(case: Case, data: dict[str, Any], method: str = "product") -> tuple[float, float]:
    """(estimate bytes, relative error) of one stored case."""
    act, logits = estimate(case, method=method)
    return act + logits, error(act + logits, traced(case, data))


def source(model: str) -> str:
    """How the estimator gets the family's terms."""
    from memory_trace import resolved

    arch = resolved(model)
    return "derived" if arch.traced is not None else f"row `{arch.model_type}`"


def derive_all(models: tuple[str, ...]) -> None:
    """Derive each family in a fresh interpreter (no torch imported yet: the cost at first use) and store it."""
    data = load_cache()
    out = data.setdefault("derivations", {})
    for model in models:
        run = subprocess.run(
            [sys.executable, "-c", COLD, json.dumps(config_of(model))],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        terms = json.loads(run.stdout.strip().splitlines()[-1])
        out[model] = terms
        print(f"  {model}: {terms['seconds_cold']} s cold ({terms['seconds']} s in derive)", file=sys.stderr)
    partial = CACHE.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    partial.replace(CACHE)


def rows() -> list[str]:
    """Every calibrated row (its model_type keys), each of which may stand in for a model it cannot trace."""
    from verl_safe_launch.memory.terms import FAMILIES

    return sorted(FAMILIES)


def bands(data: dict[str, Any]) -> dict[str, Any]:
    """The worst |error| of each calibrated row on its own family, of the derivation on every family, and of
    each row standing in for every family (full-depth traces only)."""
    from memory_trace import resolved

    own: dict[str, float] = {}
    for case in [*full_cases(), *grid(MODELS)]:
        if case.key not in data["cases"]:
            continue
        arch = resolved(case.model)
        if arch.traced is None:
            own[arch.model_type] = max(own.get(arch.model_type, 0.0), abs(case_error(case, data)[1]))
    cases = [c for c in full_cases() if c.key in data["cases"]]
    derived = max(abs(case_error(c, data, "derived")[1]) for c in cases)
    cross = {row: max(abs(case_error(c, data, f"row:{row}")[1]) for c in cases) for row in rows()}
    up = lambda x: round(x + 0.0005, 3)  # noqa: E731 - rounded up to 0.1%
    return {
        "_meta": (
            "worst |relative error| of activations plus logits against full-depth fake-tensor traces "
            "(bench/memory_families.py --bands from bench/memory_calibration.json): 'rows' a calibrated row on "
            "its own family, 'derived' terms derived from the model code on every traced family, 'fallback' a "
            "row standing in for every traced family"
        ),
        "rows": {k: up(v) for k, v in sorted(own.items())},
        "derived": up(derived),
        "fallback": {k: up(v) for k, v in sorted(cross.items())},
    }


def table(data: dict[str, Any]) -> list[str]:
    """The markdown tables: every family and stage at both shapes, then the derivation per family."""
    shapes = " | ".join(f"{b} × {s}: estimate / traced MiB | error" for b, s in FAMILY_SHAPES)
    lines = [f"| model | terms | stage | {shapes} |", "|---|---|---|" + "---:|---:|" * len(FAMILY_SHAPES)]
    for model in FULL_MODELS:
        terms = source(model)
        for mode, ckpt in MODES:
            cells = []
            for b, s in FAMILY_SHAPES:
                case = Case(model, b, s, mode, ckpt)
                est, err = case_error(case, data)
                cells.append(f"{est / MIB:,.0f} / {traced(case, data) / MIB:,.0f} | {err:+.1%}")
            lines.append(f"| {model} | {terms} | {STAGES[(mode, ckpt)]} | {' | '.join(cells)} |")
    lines += [
        "",
        "| model | derivation (cold, s) | layers traced | worst error, derived terms | worst error, estimator |",
    ]
    lines.append("|---|---:|---:|---:|---:|")
    for model in FULL_MODELS:
        d = data.get("derivations", {}).get(model)
        cases = [c for c in full_cases((model,))]
        derived = max(abs(case_error(c, data, "derived")[1]) for c in cases)
        product = max(abs(case_error(c, data)[1]) for c in cases)
        cost = f"{d['seconds_cold']:.1f}" if d else "—"
        layers = str(len(set(d["slots"]))) if d else "—"
        lines.append(f"| {model} | {cost} | {layers} | {derived:.1%} | {product:.1%} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--derive", action="store_true", help="derive every family in a fresh process")
    parser.add_argument("--bands", action="store_true", help="write the measured bands into the package data")
    parser.add_argument("--model", action="append", help="restrict --derive to these models")
    ns = parser.parse_args()
    os.environ.setdefault("VSL_CACHE_DIR", tempfile.mkdtemp(prefix="vsl-bench-"))
    if ns.derive:
        derive_all(tuple(ns.model) if ns.model else FULL_MODELS)
        return 0
    data = load_cache()
    missing = [c.key for c in full_cases() if c.key not in data["cases"]]
    if missing:
        raise SystemExit(f"{len(missing)} full-depth traces missing: run bench/calibrate_memory.py --full")
    if ns.bands:
        BANDS.write_text(json.dumps(bands(data), indent=1) + "\n")
        print(BANDS.read_text())
        return 0
    print("\n".join(table(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Calibrate the memory model: trace the real transformers modules on fake tensors and compare with the estimate.

Each case builds a model from an architecture in the bundled table (no weights) inside ``FakeTensorMode`` with
bf16 parameters (what FSDP mixed precision computes in), runs one micro batch the way verl does, and records the
peak of activation and temporary memory (parameters and their gradients are excluded: the estimator shards them
analytically). Attention is ``scaled_dot_product_attention`` with causal masking and native GQA (the memory
pattern of flash attention: output plus fp32 log-sum-exp); the log-probs use a stand-in for flash-attn's
cross-entropy kernel with the same allocations (fp32 loss and log-sum-exp per token, gradient written in place).
Every sequence is at full length (the remove-padding worst case): ``micro × seq`` tokens.

    python bench/calibrate_memory.py              # grid: cached traces + fresh estimates, table and max errors
    python bench/calibrate_memory.py --refresh    # re-trace every case (about 10 minutes on 2 cores)
    python bench/calibrate_memory.py --variants   # entropy / temperature / fused-kernel variants on one model
    python bench/calibrate_memory.py --families   # eight families, two shapes each, two layers deep
    python bench/calibrate_memory.py --census     # saved tensors of one decoder layer per family (the constants)
    python bench/calibrate_memory.py --full       # fifteen families at full depth, two shapes, every stage

Traced results are cached in bench/memory_calibration.json so the constants' provenance is reviewable.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from memory_trace import (  # noqa: E402
    CACHE,
    FAMILY_MODELS,
    FULL_MODELS,
    MODELS,
    Case,
    _build,
    architecture,
    estimate,
    family_cases,
    full_cases,
    grid,
    hf_config,
    load_cache,
    register_attention,
    trace,
    variant_cases,
)

MIB = float(1 << 20)
SAMPLING = "after each op"  # traces sampled only before each op (an older tracer) are traced again


def save_case(key: str, row: dict[str, Any]) -> None:
    """Add one traced case to the cache, re-read first so that runs in parallel keep each other's cases."""
    import fcntl

    with open(CACHE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load_cache()
        data["cases"][key] = row
        save_cache(data)


def save_cache(data: dict[str, Any]) -> None:
    import torch
    import transformers

    data["meta"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": "sdpa causal, enable_gqa (flash-attention memory pattern), CPU fake tensors",
        "cross_entropy": "flash-attn cross_entropy_loss stand-in (fp32 loss+lse, in-place gradient)",
        "tokens": "micro × seq, every sequence at full length (remove-padding worst case)",
        "excluded": "parameters, parameter gradients (FSDP shards them; the estimator adds them analytically)",
        "sampling": "before and after every op (an op's inputs and output alive together)",
    }
    partial = CACHE.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    partial.replace(CACHE)  # readers never see a half-written file


def run_cases(cases: list[Case], refresh: bool) -> dict[str, Any]:
    data = load_cache()
    todo = [c for c in cases if refresh or data["cases"].get(c.key, {}).get("sampling") != SAMPLING]
    for i, case in enumerate(todo, 1):
        row = {**trace(case), "sampling": SAMPLING}
        save_case(case.key, row)
        print(f"  traced {i}/{len(todo)} {case.key} in {row['seconds']} s", file=sys.stderr)
    return load_cache()


def error(est: float, ref: float) -> float:
    return 100.0 * (est - ref) / ref if ref else 0.0


def report(cases: list[Case], data: dict[str, Any]) -> float:
    """Print estimate vs traced per case; returns the largest |error| of the total."""
    head = f"{'case':<58} {'act est':>8} {'traced':>8} {'logit est':>9} {'traced':>8} {'total est':>9} {'traced':>8} {'err%':>6}"
    print(head)
    worst = {"activations": 0.0, "logits": 0.0, "total": 0.0}
    for case in cases:
        row = data["cases"][case.key]
        act, logit = estimate(case)
        t_total, t_logit = row["traced_total"], row["traced_logits"]
        t_act = t_total - t_logit
        err = error(act + logit, t_total)
        worst["total"] = max(worst["total"], abs(err))
        worst["activations"] = max(worst["activations"], abs(error(act, t_act)) if t_act > MIB else 0.0)
        worst["logits"] = max(worst["logits"], abs(error(logit, t_logit)) if t_logit > MIB else 0.0)
        name = case.key.replace("|default", "")
        print(
            f"{name:<58} {act / MIB:8.0f} {t_act / MIB:8.0f} {logit / MIB:9.0f} {t_logit / MIB:8.0f} "
            f"{(act + logit) / MIB:9.0f} {t_total / MIB:8.0f} {err:6.1f}"
        )
    print("MiB; max |error| %: " + ", ".join(f"{k} {v:.1f}" for k, v in worst.items()))
    return worst["total"]


def _pack(params: set[int], seen: dict[int, int], t: Any) -> Any:
    st = t.untyped_storage()
    if id(st) not in params:
        seen.setdefault(id(st), st.nbytes())
    return t


def census() -> None:
    """Bytes per token one decoder layer saves for backward, per family, against the coefficients."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from verl_safe_launch.memory import Pass, layer_saved

    register_attention()
    for model in MODELS:
        arch = architecture(model)
        cfg = hf_config(arch, layers=1, vocab=64)
        seen: dict[int, int] = {}
        with FakeTensorMode():
            m = _build(cfg, ckpt=False)
            params = {id(p.untyped_storage()) for p in m.parameters()}
            ids = torch.randint(0, 64, (1, 512))
            x = m.model.embed_tokens(ids)
            pos = torch.arange(512).unsqueeze(0)
            emb = m.model.rotary_emb(x, pos)

            with torch.autograd.graph.saved_tensors_hooks(
                functools.partial(_pack, params, seen), lambda t: t
            ):
                m.model.layers[0](x, position_embeddings=emb, attention_mask=None, position_ids=pos)
        measured = sum(seen.values()) / 512 - 4 * arch.head_dim  # cos/sin are shared by all layers
        model_bytes = layer_saved(arch, Pass(tokens=512, backward=True, vocab=arch.vocab_size))
        print(
            f"{model:<28} saved per token per layer: traced {measured:.0f} B, coefficients {model_bytes:.0f} B"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--refresh", action="store_true", help="re-trace cached cases")
    parser.add_argument("--variants", action="store_true", help="the logits post-processing variants")
    parser.add_argument("--families", action="store_true", help="every family at two shapes, few layers")
    parser.add_argument("--census", action="store_true", help="saved tensors of one layer per family")
    parser.add_argument("--full", action="store_true", help="every family at full depth, two shapes")
    parser.add_argument("--model", action="append", help="restrict the grid to these models")
    ns = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if ns.census:
        census()
        return 0
    if ns.variants:
        cases = variant_cases()
    elif ns.families:
        cases = family_cases(tuple(ns.model) if ns.model else FAMILY_MODELS)
    elif ns.full:
        cases = full_cases(tuple(ns.model) if ns.model else FULL_MODELS)
    else:
        cases = grid(tuple(ns.model) if ns.model else MODELS)
    data = run_cases(cases, ns.refresh)
    worst = report(cases, data)
    return 0 if worst <= 10.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

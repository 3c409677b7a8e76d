"""Measure the calibration cases on a real GPU and print estimate vs measured (activations + logits + temporaries).

Same grid as bench/calibrate_memory.py: Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-3.1-8B (untied, GQA) and Qwen3-0.6B
built from the bundled architecture numbers with random bf16 weights (nothing is downloaded), micro {1, 4, 8},
sequences {512, 2048}, forward-only (log-prob) and forward+backward (update) with and without gradient
checkpointing. Each case: ``torch.cuda.reset_peak_memory_stats()``, one micro batch, then
``max_memory_allocated()`` minus what was allocated before (the parameters). Attention is flash-attn 2 when
installed, else PyTorch SDPA (causal, no mask: the flash kernel); log-probs use flash-attn's cross-entropy when
installed, else a stand-in with its allocations. Parameter gradients are dropped as soon as they are accumulated
(FSDP reduce-scatters them); the head's weight gradient still coexists with the logits at the start of backward,
so the update's estimate adds it (``+ head grad``). Two extra rows check the entropy assumption on the old
log-prob: verl's ``entropy_from_logits`` eager and under ``torch.compile`` (the estimator assumes the compiled
version keeps no full-vocabulary buffer).

    python bench/gpu_memory_check.py            # about 2-3 minutes on one H100/H200
    python bench/gpu_memory_check.py --quick    # micro {1, 4}, sequence 512 only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # memory_trace: the calibration cases
sys.path.insert(0, str(HERE.parent))

MIB = float(1 << 20)


def cuda_or_exit() -> Any:
    """torch, or a clean exit when no CUDA device is present."""
    try:
        import torch
    except ImportError:
        print("gpu_memory_check: torch is not installed; nothing measured")
        raise SystemExit(0) from None
    if not torch.cuda.is_available():
        print("gpu_memory_check: no CUDA device available; nothing measured (run it on a GPU machine)")
        raise SystemExit(0)
    return torch


def attention_impl() -> str:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attention_2"


def cross_entropy() -> tuple[Any, str]:
    """flash-attn's cross_entropy_loss (log-probs = -loss), or the allocation-equivalent stand-in."""
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError:
        from memory_trace import flash_ce

        stand_in = flash_ce()
        return (lambda logits, labels, inplace: stand_in.apply(logits, labels, inplace)), "stand-in"

    def flash(logits: Any, labels: Any, inplace: bool) -> Any:
        return -cross_entropy_loss(logits, labels, inplace_backward=inplace)[0]

    return flash, "flash-attn"


def entropy_fn(compiled: bool) -> Any:
    """verl's entropy_from_logits (imported when verl is installed), optionally compiled as verl does."""
    try:
        from verl.utils.torch_functional import entropy_from_logits
    except ImportError:
        import torch

        def entropy_from_logits(logits: Any) -> Any:
            pd = torch.nn.functional.softmax(logits, dim=-1)
            return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)

    if compiled:
        import torch

        return torch.compile(entropy_from_logits, dynamic=True)
    return entropy_from_logits


def build(arch: Any, torch: Any) -> Any:
    """The model with random bf16 weights on the GPU; parameter gradients dropped once accumulated."""
    from memory_trace import _build, hf_config

    cfg = hf_config(arch)
    cfg._attn_implementation = attention_impl()
    with torch.device("cuda"):
        model = _build(cfg, ckpt=False)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))
    return model


def measure(model: Any, case: Any, torch: Any, ce: Any, entropy: Any = None) -> float:
    """Peak bytes above the parameters for one micro batch."""
    model.train(case.mode == "update")
    if case.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (case.micro, case.seq), device="cuda")
    labels = ids.reshape(-1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grad = case.mode == "update"
    with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits.reshape(-1, vocab)
        ent = entropy(logits) if entropy is not None else None
        loss = ce(logits, labels, ent is None).sum()
        del logits
        if grad:
            loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del ids, labels, loss, ent
    return float(peak)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="micro {1, 4} and sequence 512 only")
    ns = parser.parse_args()
    torch = cuda_or_exit()
    import memory_trace as cm

    ce, ce_name = cross_entropy()
    total_gib = torch.cuda.get_device_properties(0).total_memory / float(1 << 30)
    print(
        f"device {torch.cuda.get_device_name(0)} ({total_gib:.0f} GiB); attention {attention_impl()}; "
        f"cross-entropy {ce_name}"
    )
    print(f"{'case':<58} {'estimate':>9} {'+head grad':>10} {'measured':>9} {'err%':>6}")
    start, worst = time.perf_counter(), 0.0
    for model_name in cm.MODELS:
        arch = cm.architecture(model_name)
        model = build(arch, torch)
        params = torch.cuda.memory_allocated()
        cases = [c for c in cm.grid((model_name,)) if not ns.quick or (c.micro < 8 and c.seq == 512)]
        for case in cases:
            act, logits = cm.estimate(case)
            extra = 2.0 * arch.vocab_size * arch.hidden_size if case.mode == "update" else 0.0
            expected = act + logits + extra
            if params + 1.3 * expected > torch.cuda.get_device_properties(0).total_memory:
                print(
                    f"{case.key.replace('|default', ''):<58} skipped: needs ~{(params + expected) / MIB / 1024:.0f} GiB"
                )
                continue
            measured = measure(model, case, torch, ce)
            err = 100.0 * (expected - measured) / measured
            worst = max(worst, abs(err))
            print(
                f"{case.key:<58} {(act + logits) / MIB:9.0f} {extra / MIB:10.0f} {measured / MIB:9.0f} {err:6.1f}"
            )
        if model_name == cm.MODELS[0]:
            _entropy_rows(cm, model, torch, ce)
        del model
        torch.cuda.empty_cache()
    print(f"max |error| {worst:.1f}% over the grid; {time.perf_counter() - start:.0f} s")
    return 0


def _entropy_rows(cm: Any, model: Any, torch: Any, ce: Any) -> None:
    """Old log-prob with verl's entropy, eager and compiled (estimates: eager 8 B and compiled 0 B per entry)."""
    from dataclasses import replace

    case = cm.Case(cm.MODELS[0], 4, 2048, "logprob", False)
    for compiled, variant in ((False, "eager_entropy"), (True, "default")):
        act, logits = cm.estimate(replace(case, variant=variant))
        fn = entropy_fn(compiled)
        measure(model, case, torch, ce, fn)  # warm-up (compilation)
        measured = measure(model, case, torch, ce, fn)
        name = f"{case.key.replace('|default', '')} entropy {'compiled' if compiled else 'eager'}"
        err = 100.0 * (act + logits - measured) / measured
        print(f"{name:<58} {(act + logits) / MIB:9.0f} {0:10.0f} {measured / MIB:9.0f} {err:6.1f}")


if __name__ == "__main__":
    raise SystemExit(main())

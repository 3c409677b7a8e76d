"""The memory terms of any Hugging Face model, derived from its own code: one decoder layer of each distinct kind,
the embedding and the head, traced on fake tensors at a small shape and scaled per token; cached on disk per
config digest and library versions.

A layer's kind is its class, its parameters' names and shapes, its modules and its ``layer_types`` entry (sliding
or global attention, dense or mixture-of-experts...). The model is built at full depth (fake tensors hold no
memory; the parameters are counted there, a tied head once), then cut to one representative per kind and traced
three times: forward only (log-probs), and training with and without gradient checkpointing. Hooks at each
layer's boundaries split the peaks: what a layer keeps, what it needs on top while it runs forward or backward,
and the head after the last layer. The estimate re-assembles those per-token terms at the model's real depth.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from verl_safe_launch.context import Architecture, PassTerms, TracedTerms
from verl_safe_launch.inputs import cached_json
from verl_safe_launch.memory import trace

FORMAT = 1
"""Bumped when the shape of the derived terms changes (older cache entries are never read)."""
TOKENS = 1024
"""Tokens of the traced micro batch (one sequence): per-token terms do not depend on it (fake tensors cost no
memory and the same time at any size); a thousand tokens keeps per-layer constants below a byte per token."""
PASSES = (("forward", False, False), ("checkpointed", True, True), ("full", True, False))


def versions() -> str:
    """The libraries whose code the terms come from."""
    found = []
    for name in ("transformers", "torch"):
        try:
            found.append(f"{name}-{importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name}-missing")
    return "_".join(found)


def digest(config: Mapping[str, Any]) -> str:
    """What identifies a derivation: the config, the format and the library versions."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(f"{FORMAT}:{versions()}:{text}".encode()).hexdigest()[:20]


def traced_terms(config: Mapping[str, Any]) -> tuple[TracedTerms, bool]:
    """The derived terms of a config.json mapping (cached), and whether they were read from the cache."""
    name = f"models/{config.get('model_type', 'model')}-{digest(config)}.json"
    data, cached = cached_json(name, lambda: derive(config))
    terms = from_json(data)
    return replace(terms, cached=cached, path=name), cached


def with_traced(arch: Architecture) -> tuple[Architecture, str | None]:
    """The architecture with terms derived from its code, or unchanged and why the derivation failed."""
    if arch.traced is not None:
        return arch, None
    if not arch.config_json:
        return arch, "no config.json mapping to build the model from"
    try:
        terms, _ = traced_terms(json.loads(arch.config_json))
    except Exception as exc:  # any failure to build or trace the model falls back to a family
        return arch, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else 'no message'}"
    return replace(arch, traced=terms), None


def derive(config: Mapping[str, Any], tokens: int = TOKENS) -> dict[str, Any]:
    """Build the model from ``config`` on fake tensors, trace one layer of each kind, return the terms (JSON)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    trace.register_attention()
    cfg = trace.hf_config(config)
    vocab = int((getattr(cfg, "text_config", None) or cfg).vocab_size)
    with FakeTensorMode():
        model = trace.build_model(cfg)
        decoder = trace.text_model(model)
        kinds = layer_kinds(decoder)
        traced, slots = plan(kinds)
        counts = count_params(model, decoder, traced)
        prune(decoder, traced)
        passes = {}
        for name, backward, checkpointing in PASSES:
            trace.set_checkpointing(model, checkpointing)
            rec = trace.run(model, 1, tokens, backward, vocab, boundary_marks(list(decoder.layers)))
            passes[name] = reduce(rec.marks, len(traced), tokens, vocab, backward)
    return {
        "format": FORMAT,
        "slots": slots,
        "kinds": len(set(kinds)),
        "model_class": type(model).__name__,
        "tokens": tokens,
        "seconds": round(time.perf_counter() - start, 2),
        **counts,
        **passes,
    }


def layer_kinds(decoder: Any) -> list[int]:
    """The kind of each decoder layer."""
    layers = list(decoder.layers)
    types = list(getattr(decoder.config, "layer_types", None) or [None] * len(layers))
    signatures: list[tuple[Any, ...]] = []
    kinds = []
    for layer, layer_type in zip(layers, types, strict=False):
        sig = (
            layer_type,
            tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()),
            tuple(type(m).__name__ for m in layer.modules()),
        )
        if sig not in signatures:
            signatures.append(sig)
        kinds.append(signatures.index(sig))
    return kinds


def plan(kinds: list[int]) -> tuple[list[int], list[int]]:
    """The layers to trace and, for every layer of the model, which traced layer stands for it.

    The first layer is traced on its own: its input is the embedding output, which the model keeps for the
    whole forward, where a later layer's input is freed once it has run. Every kind is traced again at its
    first position after the first layer (when it has one), and stands for the rest of its kind."""
    deep = {k: i for i, k in reversed(list(enumerate(kinds))) if i > 0}
    traced = sorted({0, *deep.values()})
    slots = [0] + [traced.index(deep[k]) for k in kinds[1:]]
    return traced, slots


def count_params(model: Any, decoder: Any, reps: list[int]) -> dict[str, Any]:
    """Parameters of the whole model (a tied head once), of the vision tower and projector, and of one layer of
    each kind."""
    total = sum(p.numel() for p in model.parameters())
    text = {id(p) for p in decoder.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    own_head = sum(p.numel() for p in head.parameters() if id(p) not in text) if head is not None else 0
    text_total = sum(p.numel() for p in decoder.parameters())
    layers = list(decoder.layers)
    return {
        "params": int(total),
        "vision_params": int(total - text_total - own_head),
        "head_params": int(own_head),
        "slot_params": [int(sum(p.numel() for p in layers[i].parameters())) for i in reps],
    }


def prune(decoder: Any, reps: list[int]) -> None:
    """Keep one layer of each kind (the model's forward reads the depth and layer types from its config)."""
    import torch

    layers = list(decoder.layers)
    types = getattr(decoder.config, "layer_types", None)
    decoder.layers = torch.nn.ModuleList([layers[i] for i in reps])
    decoder.config.num_hidden_layers = len(reps)
    if types:
        decoder.config.layer_types = [types[i] for i in reps]


def boundary_marks(layers: list[Any]) -> trace.Install:
    """Hooks that mark the tracker where each layer's forward starts and ends, and where its backward starts
    (its output's gradient is ready) and ends (its input's gradient is ready); a checkpointed layer's recompute
    in backward is not marked."""

    def install(tracker: Any) -> list[Any]:
        handles = []
        for j, layer in enumerate(layers):

            def pre(module: Any, args: Any, kwargs: Any, j: int = j) -> None:
                if tracker.backward:
                    return
                if j == 0:
                    tracker.mark(f"fwd_start {j}")
                hidden = args[0] if args else kwargs.get("hidden_states")
                if getattr(hidden, "requires_grad", False):
                    hidden.register_hook(lambda grad, j=j: tracker.mark(f"bwd_end {j}"))

            def post(module: Any, args: Any, kwargs: Any, out: Any, j: int = j) -> None:
                if tracker.backward:
                    return
                tracker.mark(f"fwd_end {j}")
                tracker.pending = f"fwd_start {j + 1}"  # at the next op: the layer's input freed, or kept
                hidden = out[0] if isinstance(out, tuple) else out
                if getattr(hidden, "requires_grad", False):
                    hidden.register_hook(lambda grad, j=j: tracker.mark(f"bwd_start {j}"))

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
        return handles

    return install


def reduce(marks: list[trace.Mark], reps: int, tokens: int, vocab: int, backward: bool) -> dict[str, Any]:
    """The per-token terms of one traced pass from its boundary marks."""
    at = {m.label: i for i, m in enumerate(marks)}

    def mark(label: str) -> trace.Mark:
        if label not in at:
            raise ValueError(f"the trace never reached '{label}' (the layers were not called as expected)")
        return marks[at[label]]

    base = mark("fwd_start 0").current
    starts = [mark(f"fwd_start {j}").current for j in range(reps + 1)]  # the last: entering the head
    saved = [starts[j + 1] - starts[j] for j in range(reps)]
    rise = [mark(f"fwd_end {j}").window_peak - starts[j] for j in range(reps)]
    kept = base + sum(saved)
    if backward:
        head_mark = mark(f"bwd_start {reps - 1}")
        head = head_mark.window_peak - head_mark.window_logits - kept
        layer = []
        for j in range(reps):
            window = marks[at[f"bwd_start {j}"] + 1 : at[f"bwd_end {j}"] + 1]
            layer.append(max(m.window_peak for m in window) - (base + sum(saved[: j + 1])))
        steady = base
    else:
        head_mark = mark("end")
        steady = starts[1]
        head = head_mark.window_peak - head_mark.window_logits - steady
        layer = rise
    return {
        "base": base / tokens,
        "steady": steady / tokens,
        "saved": [s / tokens for s in saved],
        "layer": [x / tokens for x in layer],
        "rise": [x / tokens for x in rise],
        "head": head / tokens,
        "logit_extra": head_mark.window_logits / (tokens * vocab) - 2.0,
    }


def from_json(data: Mapping[str, Any]) -> TracedTerms:
    """The derived terms from their JSON form."""

    def terms(d: Mapping[str, Any]) -> PassTerms:
        return PassTerms(
            base=float(d["base"]),
            steady=float(d["steady"]),
            saved=tuple(float(x) for x in d["saved"]),
            layer=tuple(float(x) for x in d["layer"]),
            rise=tuple(float(x) for x in d["rise"]),
            head=float(d["head"]),
            logit_extra=float(d["logit_extra"]),
        )

    return TracedTerms(
        slots=tuple(int(k) for k in data["slots"]),
        kinds=int(data["kinds"]),
        forward=terms(data["forward"]),
        checkpointed=terms(data["checkpointed"]),
        full=terms(data["full"]),
        params=int(data["params"]),
        vision_params=int(data["vision_params"]),
        head_params=int(data["head_params"]),
        slot_params=tuple(int(x) for x in data["slot_params"]),
        model_class=str(data["model_class"]),
        seconds=float(data["seconds"]),
    )

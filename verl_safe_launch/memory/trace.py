"""Fake-tensor traces of a Hugging Face model's own modules: one micro batch's activation and temporary memory.

The model is built from its config (no weights) inside ``FakeTensorMode`` in bf16 (what FSDP mixed precision
computes in) and runs one micro batch the way verl's FSDP engine does: forward, the fp32 log-probs through a
stand-in for flash-attn's cross-entropy kernel with the same allocations, and backward when the stage trains.
Attention is causal ``scaled_dot_product_attention`` with native GQA, the memory pattern of flash attention
(output and fp32 log-sum-exp, no score matrix, no mask). A tracker samples live activations and temporaries before
and after every op; parameters and their gradients are set apart (FSDP shards them: the estimate adds them).

torch and transformers are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ATTENTION = "calib_sdpa"


def register_attention() -> None:
    """Causal SDPA with native GQA: keeps what flash attention keeps (output and fp32 log-sum-exp)."""
    import torch.nn.functional as F
    from transformers import AttentionInterface

    def calib_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> Any:
        width = value.shape[-1]
        if width != query.shape[-1]:  # MLA: flash attention takes the values padded to the query width
            value = F.pad(value, [0, query.shape[-1] - width])
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=kw.get("scaling"), enable_gqa=True
        )
        return out[..., :width].transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTENTION, calib_sdpa)


def hf_config(data: Mapping[str, Any]) -> Any:
    """The transformers config object of a ``config.json`` mapping, defaults filled by its own config class."""
    from transformers import AutoConfig

    values = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
    cfg = AutoConfig.for_model(str(data["model_type"]), **values)
    set_attention(cfg)
    return cfg


def set_attention(cfg: Any) -> None:
    """Route every (sub)config's attention through the tracing kernel."""
    cfg._attn_implementation = ATTENTION
    for name in ("text_config", "vision_config"):
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = ATTENTION


def build_model(cfg: Any, value_head: bool = False) -> Any:
    """The model in bf16: a causal LM, an image-text model when the config has a vision tower, or (critic) a
    token-classification model with one label."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )
    from transformers.initialization import no_init_weights

    auto: Any = AutoModelForCausalLM
    if value_head:
        cfg.num_labels, cfg.classifier_dropout = 1, 0.0
        auto = AutoModelForTokenClassification
    elif getattr(cfg, "vision_config", None) is not None:
        auto = AutoModelForImageTextToText
    torch.set_default_dtype(torch.bfloat16)
    try:
        with (
            no_init_weights()
        ):  # random initialization draws data-dependent values, which fake tensors have not
            model = auto.from_config(cfg, dtype=torch.bfloat16)  # whatever dtype the checkpoint is stored in
    finally:
        torch.set_default_dtype(torch.float32)
    model.tie_weights()  # skipped with the initialization: a tied head shares the embedding's parameter
    return model


def text_model(model: Any) -> Any:
    """The decoder stack (the module holding ``layers``) of a causal or image-text model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and hasattr(decoder, "layers"):
        return decoder
    for module in model.modules():
        if hasattr(module, "layers") and hasattr(module, "embed_tokens"):
            return module
    raise ValueError(f"{type(model).__name__} has no decoder layers")


def set_checkpointing(model: Any, on: bool) -> None:
    """Gradient checkpointing of every decoder layer (non-reentrant, as verl enables it)."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def flash_ce() -> Any:
    """Stand-in for flash_attn's cross_entropy_loss: fp32 loss and lse per row, gradient written into the logits."""
    import torch

    class FlashCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, labels: Any, inplace: bool) -> Any:
            rows = logits.shape[0]
            lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
            loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
            ctx.save_for_backward(logits, lse, labels)
            ctx.inplace = inplace
            return -loss

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            logits, _lse, _labels = ctx.saved_tensors
            return (logits if ctx.inplace else torch.empty_like(logits)), None, None

    return FlashCrossEntropy


def log_prob_loss(model: Any, ids: Any, vocab: int) -> Any:
    """One micro batch as verl's FSDP engine computes log-probs (remove padding: one row per token)."""
    raw = model(input_ids=ids, use_cache=False).logits
    logits = raw.reshape(-1, vocab)
    log_probs = flash_ce().apply(logits, ids.reshape(-1), True)
    del raw, logits
    return log_probs.sum()


@dataclass
class Mark:
    """Memory at one point of a trace, and the peak since the mark before (bytes)."""

    label: str
    current: int
    window_peak: int
    window_logits: int


@dataclass
class Recording:
    """What a traced pass leaves: its peak, the logits alive at the peak, the op there, and the marks."""

    peak: int = 0
    peak_logits: int = 0
    peak_op: str = ""
    marks: list[Mark] = field(default_factory=list)


def make_tracker(model: Any, vocab: int) -> Any:
    """A MemTracker that records the peak of activations + temporaries (weight gradients set apart), and marks."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils._pytree import tree_leaves, tree_map_only

    class PeakTracker(MemTracker):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()
            self.param_shapes = {tuple(p.shape) for p in model.parameters()}
            self.backward = False
            self.peak, self.peak_logits, self.logits_live, self.peak_op = 0, 0, 0, ""
            self.window, self.window_logits = 0, 0
            self.marks: list[Mark] = []
            self.pending: str | None = None  # a mark to take before the next op

        def _update_peak_stats(self, peak_state: Any) -> None:  # module-wise peaks are not needed (and slow)
            pass

        def current(self) -> int:
            return sum(s[_MemRefType.ACT] + s[_MemRefType.TEMP] for s in self._curr_mem_snap.values())

        def sample(self, label: str) -> None:
            cur = self.current()
            if cur > self.peak:
                self.peak, self.peak_logits, self.peak_op = cur, self.logits_live, label
            if cur > self.window:
                self.window, self.window_logits = cur, self.logits_live

        def mark(self, label: str) -> None:
            cur = self.current()
            self.sample(label)
            self.marks.append(Mark(label, cur, self.window, self.window_logits))
            self.window, self.window_logits = cur, self.logits_live

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # sampled before each op (frees since the last op are counted) and after it, while the op's inputs
            # and its output are alive together: an output that lives for one op is part of the peak
            if self.pending is not None:
                label, self.pending = self.pending, None
                self.mark(label)
            self.sample(str(func))
            res = func(*args, **(kwargs or {}))
            reftype = _MemRefType.TEMP if self.backward else _MemRefType.ACT
            if self.backward and self._weight_grad(res, args, kwargs):
                reftype = _MemRefType.OTH
            tree_map_only(torch.Tensor, functools.partial(self._track_logits, reftype), res)
            self.sample(f"{func} (output)")
            return res

        def _track_logits(self, reftype: Any, t: Any) -> None:
            st = t.untyped_storage()
            winfo: Any = self._WINFO
            new = winfo.get(st, (None, None))[0] is None
            self._track(reftype, t)
            if new and t.dim() >= 2 and t.shape[-1] == vocab and reftype is not _MemRefType.OTH:
                size = st.nbytes()
                self.logits_live += size
                weakref.finalize(st, self._drop_logits, size)

        def _drop_logits(self, size: int) -> None:
            self.logits_live -= size

        def _weight_grad(self, res: Any, args: Any, kwargs: Any) -> bool:
            outs = [t for t in tree_leaves(res) if isinstance(t, torch.Tensor)]
            if len(outs) != 1 or tuple(outs[0].shape) not in self.param_shapes:
                return False
            winfo: Any = self._WINFO
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    info = winfo.get(t.untyped_storage(), (None, None))[0]
                    if info is not None and info.reftype == _MemRefType.PARAM:
                        return False
            return True

    return PeakTracker()


Install = Callable[[Any], list[Any]]
"""Registers hooks that mark the tracker (at module boundaries); returns their handles."""


def run(
    model: Any, micro: int, seq: int, backward: bool, vocab: int, install: Install | None = None
) -> Recording:
    """Trace one micro batch (``micro`` sequences of ``seq`` tokens) on an already built fake model."""
    import torch

    model.train(backward)
    ids = torch.randint(0, vocab, (micro, seq))
    tracker = make_tracker(model, vocab)
    tracker.track_external(model)
    handles = install(tracker) if install is not None else []
    try:
        with tracker, torch.set_grad_enabled(backward):
            loss = log_prob_loss(model, ids, vocab)
            if backward:
                tracker.pending = None
                tracker.backward = True
                loss.backward()
            tracker.mark("end")
    finally:
        for handle in handles:
            handle.remove()
    return Recording(tracker.peak, tracker.peak_logits, tracker.peak_op, tracker.marks)


def optimizer_step(foreach: bool = True, fused: bool = False, tensors: int = 8) -> float:
    """Temporary memory of one AdamW step (after its states exist), per byte of the fp32 parameters it updates,
    with verl's gradient clipping before it: traced on fake parameters."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(1024, 1024, dtype=torch.float32)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.empty_like(p)
        opt = torch.optim.AdamW(params, lr=1e-6, foreach=foreach, fused=fused)
        tracker: Any = MemTracker()
        tracker.track_external(*params, opt)
        with tracker:
            opt.step()  # the first step creates the two states
            tracker.reset_mod_stats()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
            opt.step()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    size = sum(p.numel() for p in params) * 4
    return float(peak[_MemRefType.OPT] + peak[_MemRefType.TEMP]) / size - 2.0

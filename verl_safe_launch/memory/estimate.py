"""Per-stage GPU memory estimate (rollout, log-probs, actor update, critic) with its assumptions and verdicts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from verl_safe_launch.config_view import ARR
from verl_safe_launch.context import RuleContext
from verl_safe_launch.memory.assumptions import (
    architecture_lines,
    dtype_name,
    entropy_line,
    logits_path,
    offload_text,
)
from verl_safe_launch.memory.engine import Engine, StageSpec, make_pass, read_engine, stage_specs
from verl_safe_launch.memory.host import HostEstimate, host_estimate
from verl_safe_launch.memory.rollout import Finish, RolloutFacts, rollout_facts, rollout_stage
from verl_safe_launch.memory.sources import TermSource, resolve
from verl_safe_launch.memory.terms import (
    BF16,
    FP32,
    GIB,
    layer_params,
    pass_peak,
    root_params,
    vision_params,
)
from verl_safe_launch.rules import BatchPlan, batch_plan

COMPONENTS = (
    "parameters",
    "gradients",
    "optimizer",
    "gathered parameters",
    "activations",
    "logits and temporaries",
    "KV cache",
    "fixed overhead",
)
# Relative uncertainty per component: shards are exact arithmetic; activations and logits take the band measured
# for the source of their terms (sources.py), the other entries here are not traced.
UNCERTAINTY = {
    "parameters": 0.02,
    "gradients": 0.02,
    "optimizer": 0.02,
    "gathered parameters": 0.25,
    "activations": 0.10,
    "logits and temporaries": 0.10,
    "KV cache": 0.02,
    "fixed overhead": 0.50,
}
FRAGMENTATION = 0.05  # the caching allocator's unusable slack, added to the high end of the band
DEFAULT_MARGIN = 0.10
DEFAULT_OVERHEAD_GIB = 1.0
MODEL_KEY = {"actor": f"{ARR}.model.path", "critic": "critic.model.path"}


@dataclass(frozen=True)
class StageEstimate:
    """One stage's peak per GPU: GiB per component, the phase that peaks, the band and the verdict."""

    name: str
    components: tuple[tuple[str, float], ...]
    phase: str
    batch: str
    knob: str | None
    low: float
    high: float
    verdict: str | None = None
    phases: tuple[tuple[str, float], ...] = ()
    batch_gib: float = 0.0  # activations and logits of one micro batch at its peak
    traced: bool = True  # the model's terms were checked against traces of its code (a row or a derivation)
    band: float = 0.0  # the measured relative error of the activations and logits

    @property
    def verdict_text(self) -> str | None:
        """The verdict, saying so when it rests on an untraced family's wide band."""
        if self.verdict is None or self.traced:
            return self.verdict
        return f"{self.verdict} ({UNTRACED})"

    @property
    def total(self) -> float:
        """The estimated peak in GiB."""
        return sum(v for _, v in self.components)

    def get(self, component: str) -> float:
        """GiB of one component (0 when absent)."""
        return dict(self.components).get(component, 0.0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Every stage's estimate, the assumptions behind them, and the GPU they are judged against."""

    stages: tuple[StageEstimate, ...]
    assumptions: tuple[str, ...]
    gpu_memory_gib: float | None
    margin: float
    missing: str | None = None
    rollout: RolloutFacts | None = None
    notes: tuple[str, ...] = field(default=())
    host: HostEstimate | None = None
    terms: str = ""
    """Where the activation and logits terms come from (a calibrated row, derived from the model code...)."""

    def stage(self, name: str) -> StageEstimate | None:
        """The estimate of one stage by name."""
        return next((s for s in self.stages if s.name == name), None)

    @property
    def peak(self) -> StageEstimate | None:
        """The stage with the largest peak."""
        return max(self.stages, key=lambda s: s.total, default=None)


UNTRACED = "model code not traced"


FITS, DOES_NOT_FIT, OUT_OF_MEMORY = "fits", "does not fit", "out of memory"


def stage_fits(total: float, high: float, gpu: float, margin: float) -> bool:
    """The one test of ``estimate``, ``check`` and ``--fit``: the estimate with the margin, and the band's top,
    within the GPU."""
    return total * (1 + margin) <= gpu and high <= gpu


def verdict(total: float, high: float, gpu: float | None, margin: float) -> str | None:
    """``fits`` (``stage_fits``), ``out of memory`` (the estimate itself is over the GPU size), else ``does not
    fit`` (within the GPU, but not with the margin or not with the band's top); None without a GPU size."""
    if gpu is None:
        return None
    if stage_fits(total, high, gpu, margin):
        return FITS
    return DOES_NOT_FIT if total <= gpu else OUT_OF_MEMORY


def finish(
    name: str, parts: Mapping[str, float], phase: str, batch: str, knob: str | None, ctx: Settings
) -> StageEstimate:
    """Bytes per component → a stage estimate in GiB with its band and verdict."""
    gib = tuple((c, parts.get(c, 0.0) / GIB) for c in COMPONENTS if parts.get(c, 0.0) > 0)
    total = sum(v for _, v in gib)
    measured = {"activations", "logits and temporaries"}
    spread = sum(v * (ctx.source.band if c in measured else UNCERTAINTY[c]) for c, v in gib)
    high, low = total + spread + FRAGMENTATION * total, total - spread
    judged = verdict(total, high, ctx.gpu, ctx.margin)
    return StageEstimate(
        name, gib, phase, batch, knob, low, high, judged, traced=ctx.calibrated, band=ctx.source.band
    )


@dataclass(frozen=True)
class Settings:
    """What every stage needs: GPU size, margin, overhead, sequence length and the engines."""

    gpu: float | None
    margin: float
    overhead: float
    seq_len: int
    plan: BatchPlan
    actor: Engine
    critic: Engine | None
    calibrated: bool
    rollout_asleep: bool
    specs: tuple[StageSpec, ...]
    source: TermSource
    notes: tuple[str, ...] = ()
    optimizer: str = "AdamW"
    logits_path: str = ""
    prompt_len: int = 0


def resident(engine: Engine | None, stage: str, running: bool) -> dict[str, float]:
    """Bytes of one engine's shards on the GPU during a stage (offloaded state is on the CPU)."""
    if engine is None or engine.cpu_policy:
        return {}
    own = running and engine.role != "ref"
    updating = own and stage in ("actor update", "critic")
    out: dict[str, float] = {}
    if not engine.param_offload or own:
        out["parameters"] = engine.params * engine.dtype_bytes / engine.shards
    if updating:
        out["gradients"] = engine.trainable * engine.dtype_bytes / engine.shards
    if not engine.optimizer_offload or updating:
        out["optimizer"] = 2 * engine.trainable * engine.dtype_bytes / engine.shards
    return out


def gathered(engine: Engine, backward: bool) -> float:
    """Unsharded bf16 parameters in flight (head unit + prefetched layers) and, in backward, layer gradients."""
    arch = engine.arch
    layer, root = layer_params(arch), root_params(arch, engine.value_head)
    if arch.vision:  # FSDP wraps each vision block as its own unit, like a decoder layer
        root -= arch.vision.depth * arch.vision.block_params if arch.traced is None else vision_params(arch)
    if not engine.reshard_after_forward:
        return BF16 * engine.params + (BF16 + FP32) * layer * backward
    layers = 1 + int(engine.forward_prefetch or backward)
    held: float = BF16 * root + BF16 * layers * layer
    if backward:
        trainable_layer = layer if not engine.lora_rank else engine.lora_params / arch.num_hidden_layers
        held += (BF16 + FP32) * trainable_layer + (0 if engine.lora_rank else BF16 * root)
    return held


def add(*parts: Mapping[str, float]) -> dict[str, float]:
    """Sum component dictionaries."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def training_stage(spec: StageSpec, s: Settings) -> StageEstimate:
    """One log-prob, update or critic stage: resident shards + the peak of one micro batch."""
    e = spec.engine
    base = _base(spec, s)
    tokens = spec.tokens(s.seq_len)
    peak = pass_peak(e.arch, make_pass(spec, tokens, s.seq_len, s.prompt_len))
    during = {"gathered parameters": gathered(e, spec.backward), "activations": peak.activations}
    during["logits and temporaries"] = peak.logits
    parts, phase = add(base, during), peak.phase
    if not spec.backward:
        stage = finish(spec.name, parts, phase, spec.describe(s.seq_len), spec.knob, s)
        return replace(stage, batch_gib=peak.total / GIB)
    options = _phases(parts, phase, base, e)
    parts, phase = max(options, key=lambda o: sum(o[0].values()))
    stage = finish(spec.name, parts, phase, spec.describe(s.seq_len), spec.knob, s)
    named = zip(UPDATE_PHASES, options, strict=True)
    phases = tuple((name, sum(o[0].values()) / GIB) for name, o in named)
    return replace(stage, phases=phases, batch_gib=peak.total / GIB)


def _base(spec: StageSpec, s: Settings) -> dict[str, float]:
    e = spec.engine
    return add(
        resident(s.actor, spec.name, e is s.actor),
        resident(s.critic, spec.name, e is s.critic),
        {"fixed overhead": s.overhead * GIB * 2},
    )


Phase = tuple[dict[str, float], str]
UPDATE_PHASES = ("micro batch", "end of backward", "optimizer step")


OPTIMIZER_STEP_TEMP = 1.0
"""Temporaries of torch's AdamW step (foreach, verl's default on GPUs), per byte of the parameters it updates: one
copy (the square root of the second moments, computed for the whole shard at once). Traced on fake tensors by
``trace.optimizer_step`` (tests/test_memory_derive.py holds the two equal)."""


def _phases(parts: dict[str, float], phase: str, base: dict[str, float], e: Engine) -> list[Phase]:
    """The micro-batch peak, the end of backward (head gradients reduced in fp32) and the optimizer step."""
    root = root_params(e.arch, e.value_head) if not e.lora_rank else 0
    reduce = add(base, {"gathered parameters": (BF16 + BF16 + FP32) * root})
    step = add(base, {"logits and temporaries": OPTIMIZER_STEP_TEMP * e.trainable * e.dtype_bytes / e.shards})
    return [(parts, phase), (reduce, "end of backward (head gradient reduce)"), (step, "optimizer step")]


def assumptions(s: Settings, specs: list[StageSpec], rollout: RolloutFacts | None) -> tuple[str, ...]:
    """The assumptions behind the numbers, one line each."""
    a = s.actor
    lines = [
        f"GPU memory {s.gpu:g} GiB (hardware.gpu_memory_gb), verdict margin {s.margin:.0%}"
        if s.gpu
        else "GPU memory unknown: no verdicts (set hardware.gpu_memory_gb=80)",
        f"sequences at full length {s.seq_len} tokens (remove-padding worst case: every sequence prompt+response)",
        f"actor shards: params {dtype_name(a)} over {a.shards} GPUs, AdamW states in the same dtype, grads only in "
        "the update" + offload_text(a),
        "mixed precision: bf16 compute, layers all-gathered one unit at a time (head unit kept during forward)",
        "gradient checkpointing " + ("on: one layer input kept per layer" if a.checkpointing else "off"),
        s.logits_path,
        entropy_line(a),
        "ref model: parameters on the CPU between layers (verl forces CPU offload for forward-only engines)",
        f"fixed overhead {s.overhead:g} GiB per process: the trainer and the sleeping rollout server",
        f"activation and logits terms: {s.source.how}",
        f"band: shards ±2%, activations and logits ±{s.source.band:.1%} (the worst error measured against "
        "full-depth traces, bench/memory_families.py), gathered ±25%, overhead ±50%, plus 5% allocator "
        "fragmentation on the high end",
    ]
    if s.optimizer not in ("AdamW", "Adam", "adamw", "adam"):
        lines.append(f"optimizer {s.optimizer}: assumed to keep two states per parameter like AdamW")
    if a.sp > 1:
        lines.append(f"Ulysses sequence parallel {a.sp}: each GPU holds 1/{a.sp} of a micro batch's tokens")
    if a.lora_rank:
        lines.append(
            f"LoRA rank {a.lora_rank}: gradients and optimizer for the adapters only; ref inside the actor"
        )
    if a.megatron:
        lines.append("model_engine=megatron: modelled as FSDP with the same sharding (indicative only)")
    lines.append(
        f"'fits': the estimate with the {s.margin:.0%} margin and the band's top within the GPU (what --fit "
        "proposes); 'does not fit': within the GPU but not so; 'out of memory': the estimate itself is over it"
    )
    lines.extend(architecture_lines(a.arch))
    if any(spec.dynamic for spec in specs):
        lines.append("dynamic batch size: a micro batch fills its token budget")
    if rollout is not None:
        lines.extend(rollout.assumptions)
    return tuple(lines)


def prepare(ctx: RuleContext, margin: float, overhead_gib: float) -> Settings | str:
    """The settings every stage needs, or why the model is unknown."""
    view, plan = ctx.view, batch_plan(ctx.view)
    if ctx.actor_arch is None:
        return _unknown(view.get(MODEL_KEY["actor"]), "actor")
    gpus = plan.gpus or 1
    flash, path = logits_path(ctx)
    source = resolve(ctx.actor_arch)
    arch = source.arch
    actor = replace(read_engine(view, "actor", arch, gpus), flash_ce=flash)
    ref = None
    if plan.use_ref:
        ref = actor if actor.lora_rank else replace(read_engine(view, "ref", arch, gpus), flash_ce=flash)
    critic: Engine | None = None
    notes: tuple[str, ...] = ()
    if plan.use_critic and ctx.critic_arch is None:
        notes = ("critic stage not estimated: " + _unknown(view.get(MODEL_KEY["critic"]), "critic"),)
    elif plan.use_critic and ctx.critic_arch is not None:
        critic = read_engine(view, "critic", resolve(ctx.critic_arch).arch, gpus)
    calibrated = source.traced and not actor.megatron
    asleep = view.get(f"{ARR}.rollout.free_cache_engine") is not False
    gpu = ctx.hardware.gpu_memory_gb
    s = Settings(
        gpu,
        margin,
        overhead_gib,
        plan.max_seq_len or 1024,
        plan,
        actor,
        critic,
        calibrated,
        asleep,
        (),
        source,
        notes,
    )
    optimizer = str(view.get(f"{ARR}.actor.optim.optimizer") or "AdamW")
    specs = tuple(stage_specs(view, plan, actor, ref, critic))
    prompt = view.get("data.max_prompt_length")
    prompt_len = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt > 0 else 0
    return replace(s, specs=specs, optimizer=optimizer, logits_path=path, prompt_len=prompt_len)


def estimate_memory(
    ctx: RuleContext, *, margin: float = DEFAULT_MARGIN, overhead_gib: float = DEFAULT_OVERHEAD_GIB
) -> MemoryEstimate:
    """Per-stage, per-component GPU memory of one config (pure: architecture, config, hardware)."""
    s = prepare(ctx, margin, overhead_gib)
    if isinstance(s, str):
        return MemoryEstimate((), (), ctx.hardware.gpu_memory_gb, margin, missing=s)
    assert ctx.actor_arch is not None
    facts = rollout_facts(ctx.view, s.plan, s.actor.arch, s.gpu, _resident_total(s))
    stages = [rollout_stage(facts, _base_rollout(s), s.overhead, finish_fn(s))]
    stages += [_pooled(training_stage(spec, s), facts, s) for spec in s.specs]
    lines = assumptions(s, list(s.specs), facts)
    host = _host(ctx, s)
    return MemoryEstimate(
        tuple(stages), lines, s.gpu, margin, rollout=facts, notes=s.notes, host=host, terms=s.source.how
    )


def _host(ctx: RuleContext, s: Settings) -> HostEstimate:
    engines = [
        s.actor,
        *(sp.engine for sp in s.specs if sp.engine.role == "ref" and sp.engine is not s.actor),
    ]
    engines += [s.critic] if s.critic is not None else []
    per_node = s.plan.gpus_per_node or ctx.hardware.gpus_per_node or 1
    return host_estimate(ctx.view, tuple(engines), per_node, ctx.hardware.host_memory_gb)


def stage_at(
    ctx: RuleContext, name: str, *, margin: float = DEFAULT_MARGIN, overhead_gib: float = DEFAULT_OVERHEAD_GIB
) -> Callable[[int], StageEstimate] | None:
    """One training stage as a function of its knob (micro batch, or token budget under dynamic batching)."""
    s = prepare(ctx, margin, overhead_gib)
    if isinstance(s, str) or ctx.actor_arch is None:
        return None
    spec = next((sp for sp in s.specs if sp.name == name), None)
    if spec is None:
        return None
    facts = rollout_facts(ctx.view, s.plan, s.actor.arch, s.gpu, _resident_total(s))
    found = spec

    def at(value: int) -> StageEstimate:
        changed = replace(found, budget=value) if found.dynamic else replace(found, micro=value)
        return _pooled(training_stage(changed, s), facts, s)

    return at


def finish_fn(s: Settings) -> Finish[StageEstimate]:
    """``finish`` bound to the settings (for the rollout module)."""

    def run(name: str, parts: Mapping[str, float], phase: str, batch: str, knob: str | None) -> StageEstimate:
        return finish(name, parts, phase, batch, knob, s)

    return run


def _base_rollout(s: Settings) -> dict[str, float]:
    return add(resident(s.actor, "rollout", False), resident(s.critic, "rollout", False))


def _resident_total(s: Settings) -> float:
    return sum(_base_rollout(s).values()) + s.overhead * GIB


def _pooled(stage: StageEstimate, facts: RolloutFacts, s: Settings) -> StageEstimate:
    """A training stage with the rollout pool still held (``free_cache_engine: false``)."""
    if s.rollout_asleep or not facts.pool_bytes:
        return stage
    parts = {c: v * GIB for c, v in stage.components}
    parts["KV cache"] = parts.get("KV cache", 0.0) + facts.pool_bytes
    pooled = finish(stage.name, parts, stage.phase, stage.batch, stage.knob, s)
    extra = facts.pool_bytes / GIB
    return replace(
        pooled, phases=tuple((name, v + extra) for name, v in stage.phases), batch_gib=stage.batch_gib
    )


def _unknown(path: object, role: str) -> str:
    key = MODEL_KEY[role]
    why = (
        f"no architecture for {role} model '{path}': not a local directory with config.json, not in the local "
        f"Hugging Face cache, not in the bundled table; set {key} to a local model directory (config.json is "
        "enough) or a known Hugging Face repo id"
    )
    return why

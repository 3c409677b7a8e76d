"""Presets: what each is meant for, which one ``auto`` picks, and their adaptation to the real hardware."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from verl_safe_launch.compose import Composed, compose, preset_dir
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import Architecture, RuleContext
from verl_safe_launch.errors import UsageError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import (
    GPU_KEYS,
    ComposeRequest,
    HardwareProfile,
    count_of,
    detect_hardware,
    hardware_fills,
    load_architecture,
    read_yaml,
    split_tool_tokens,
)
from verl_safe_launch.memory import (
    MemoryEstimate,
    StageEstimate,
    estimate_memory,
    fit_knobs,
    memory_findings,
    stage_at,
)
from verl_safe_launch.provenance import Layer, Source, Write
from verl_safe_launch.rules import (
    ACTOR_MICRO,
    ACTOR_MINI,
    LOGPROB_MICRO,
    REF_MICRO,
    ROLLOUT_N,
    ROLLOUT_TP,
    TRAIN_BATCH,
    batch_plan,
    divisors,
    nearest,
    pos_int,
    rollout_tp_ok,
    sync_steps,
    with_values,
)

AUTO = "auto"
ACTOR_SP = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
REF_SP = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size"
GPU_UTIL = "actor_rollout_ref.rollout.gpu_memory_utilization"
MAX_MODEL_LEN = "actor_rollout_ref.rollout.max_model_len"
MICRO_KEYS = (ACTOR_MICRO, LOGPROB_MICRO, REF_MICRO)
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"
_USER_LAYERS = (Layer.FILE, Layer.SCRIPT, Layer.CLI)


@dataclass(frozen=True)
class PresetInfo:
    """What a preset is for: the hardware it was tuned on and the model sizes it suits."""

    name: str
    hardware: str
    models: str
    summary: str


PRESETS: dict[str, PresetInfo] = {
    "small": PresetInfo("small", "1-2 GPUs, one machine", "7B-13B", "short steps, TP 1, small micro batches"),
    "medium": PresetInfo("medium", "6-8 GPUs, one node", "13B-34B", "48 prompts x 12 samples, rollout TP 2"),
    "cluster": PresetInfo(
        "cluster", "several nodes x 8 GPUs", "70B+", "FSDP + Ulysses 4 (remove padding on), rollout TP 2"
    ),
    AUTO: PresetInfo(
        AUTO, "picked from the hardware", "-", "up to 2 GPUs: small; one node: medium; more: cluster"
    ),
}


def preset_values(name: str) -> list[tuple[str, Any, int]]:
    """``(key, value, line)`` of ``conf/preset/NAME.yaml`` in file order (``defaults``/``hydra`` left out)."""
    doc = read_yaml(preset_dir() / f"{name}.yaml", expand_dots=True)
    skipped = ("defaults", "hydra")
    return [(leaf.key, leaf.value, leaf.line) for leaf in doc.leaves if leaf.key.split(".")[0] not in skipped]


# --- auto --------------------------------------------------------------------------------------------


def choose_auto(
    profile: HardwareProfile, view: ConfigView | None, where: str | None = None
) -> tuple[str, str]:
    """The preset ``auto`` stands for, and why: up to 2 GPUs small, one node medium, several nodes cluster."""
    counts = _auto_counts(profile, view)
    if counts is None:
        raise UsageError(
            "preset=auto cannot pick a preset: the number of GPUs is unknown",
            where=where,
            fix="declare the hardware, e.g. hardware.gpus_per_node=8 hardware.nodes=1, or run inside the "
            "Slurm allocation or on the GPU machine",
        )
    gpus, nodes, why = counts
    name = "cluster" if nodes > 1 else "small" if gpus * nodes <= 2 else "medium"
    plural = "s" if nodes > 1 else ""
    return name, f"{gpus * nodes} GPUs on {nodes} node{plural}; {why}"


def _auto_counts(profile: HardwareProfile, view: ConfigView | None) -> tuple[int, int, str] | None:
    if profile.gpus_per_node is not None:
        nodes = profile.nodes.value if profile.nodes else 1
        return profile.gpus_per_node.value, nodes, profile.gpus_per_node.source.reason or "hardware"
    if view is None:
        return None
    gpus, user_nodes = (_user_int(view, key) for key, _, _ in GPU_KEYS)
    if gpus is None:
        return None
    prov = view.prov(GPU_KEYS[0][0])
    return (
        gpus,
        user_nodes or 1,
        f"trainer.n_gpus_per_node from {prov.source.describe() if prov else 'the config'}",
    )


def _user_int(view: ConfigView, key: str) -> int | None:
    prov = view.prov(key)
    if prov is None or prov.source.layer not in _USER_LAYERS:
        return None
    return pos_int(prov.value)


# --- composition with a preset ---------------------------------------------------------------------------


def compose_for_launch(request: ComposeRequest, *, fit: bool = False) -> Composed:
    """Compose with hardware fills and, when a preset is named, with the preset adapted to the hardware."""
    _, tool = split_tool_tokens(request.overrides)
    profile = detect_hardware(tool)
    request = replace(request, fills=request.fills + hardware_fills(profile))
    return compose_with_preset(request, profile, fit=fit)


def compose_with_preset(request: ComposeRequest, profile: HardwareProfile, *, fit: bool = False) -> Composed:
    """Compose once, compute the preset's hardware adaptations, compose again with them (``adapted``)."""
    _, tool = split_tool_tokens(request.overrides)
    name = request.preset or (tool.preset[0] if tool.preset else None)
    if name is None:
        plain = compose(request)
        filled = _fill_missing(plain, profile) if fit else ()
        return compose(replace(request, adapted=request.adapted + filled)) if filled else plain
    where = tool.preset[1].describe() if tool.preset else None
    first: Composed | None = None
    if name == AUTO:
        if profile.gpus_per_node is None:
            first = compose(replace(request, preset="medium"))
        name = choose_auto(profile, first.view if first else None, where)[0]
        if name != "medium":
            first = None
    request = replace(request, preset=name)
    first = first or compose(request)
    adapted = adapt_preset(first, name, profile, fit=fit)
    result = compose(replace(request, adapted=request.adapted + adapted)) if adapted else first
    filled = _fill_missing(result, profile) if fit else ()
    if not filled:
        return result
    return compose(replace(request, adapted=request.adapted + adapted + filled))


def _fill_missing(composed: Composed, profile: HardwareProfile) -> tuple[Write, ...]:
    """``--fit``: every micro-batch knob nobody set (null) gets the fitted value, with the fit's reason."""
    facts = profile.facts()
    view = composed.view
    arch = load_architecture(view.get("actor_rollout_ref.model.path"))
    if facts.gpu_memory_gb is None or arch is None:
        return ()
    critic = load_architecture(view.get("critic.model.path"))
    ctx = RuleContext(view, arch, critic, facts)
    fits = fit_knobs(ctx)
    writes = [
        Write(knob.key, knob.value, Source(Layer.ADAPTED, reason=f"--fit: unset; {knob.reason}"))
        for knob in fits
        if knob.value is not None and view.get(knob.key) is None and not knob.add
    ]
    actor = next((k for k in fits if k.key == ACTOR_MICRO and k.value is not None), None)
    if (
        batch_plan(view).use_critic
        and view.get(CRITIC_MICRO) is None
        and actor is not None
        and critic is not None
        and critic.params <= arch.params
        and view.get("critic.ppo_mini_batch_size") == view.get(ACTOR_MINI)
    ):
        why = (
            f"--fit: unset; the actor's fitted micro batch ({actor.reason}): the critic trains on the same "
            f"per-GPU mini batch with a model no larger ({critic.params / 1e9:.1f}B ≤ {arch.params / 1e9:.1f}B)"
        )
        writes.append(Write(CRITIC_MICRO, actor.value, Source(Layer.ADAPTED, reason=why)))
    return tuple(writes)


# --- adaptation ------------------------------------------------------------------------------------------


class _Adaptation:
    """The changes made so far to the keys a preset owns (keys nobody else set), with their reasons."""

    def __init__(
        self, view: ConfigView, name: str, profile: HardwareProfile, arch: Architecture | None
    ) -> None:
        self.base = view
        self.name = name
        self.profile = profile
        self.arch = arch
        self.changes: dict[str, tuple[Any, str]] = {}
        self.view = view

    def owned(self, key: str) -> bool:
        prov = self.base.prov(key)
        return prov is not None and prov.source.layer is Layer.PRESET

    def free(self, key: str) -> bool:
        """Nobody chose the value: it is the preset's or verl's default (a memory knob may move it)."""
        prov = self.base.prov(key)
        return prov is not None and prov.source.layer in (Layer.PRESET, Layer.VERL)

    def value(self, key: str) -> int | None:
        return pos_int(self.view.get(key))

    def change(self, key: str, value: Any, reason: str, *, knob: bool = False) -> None:
        allowed = self.free(key) if knob else self.owned(key)
        if allowed and value != self.view.get(key):
            self.changes[key] = (value, reason)
            self.view = with_values(self.base, {k: v for k, (v, _) in self.changes.items()})

    @property
    def gpus(self) -> int | None:
        return batch_plan(self.view).gpus

    def writes(self) -> tuple[Write, ...]:
        return tuple(
            Write(key, value, Source(Layer.ADAPTED, reason=f"preset {self.name}: {reason}"))
            for key, (value, reason) in self.changes.items()
        )


def adapt_preset(
    composed: Composed, name: str, profile: HardwareProfile, *, fit: bool = False
) -> tuple[Write, ...]:
    """Writes that move the preset's own values to what the hardware allows, each with its reason."""
    arch = load_architecture(composed.view.get("actor_rollout_ref.model.path"))
    state = _Adaptation(composed.view, name, profile, arch)
    for step in (
        _gpu_counts,
        _ulysses,
        _rollout_tp,
        _train_batch,
        _mini_batch,
        _micro_divisors,
        _memory_plan,
    ):
        step(state)
    _fit_micro(state, fit)
    return state.writes()


def _gpu_counts(state: _Adaptation) -> None:
    for key, name, noun in GPU_KEYS:
        fact = getattr(state.profile, name)
        if fact is not None:
            state.change(
                key, fact.value, f"the hardware has {count_of(fact.value, noun)}: {fact.source.reason}"
            )


def _heads_ok(arch: Architecture | None, size: int) -> bool:
    if arch is None:
        return True
    kv = arch.num_key_value_heads
    return arch.num_attention_heads % size == 0 and (kv % size == 0 or size % kv == 0)


def _heads_clause(arch: Architecture | None) -> str:
    if arch is None:
        return ""
    return f" and the heads ({arch.num_attention_heads} attention, {arch.num_key_value_heads} KV)"


def _ulysses(state: _Adaptation) -> None:
    current, gpus = state.value(ACTOR_SP), state.gpus
    if not state.owned(ACTOR_SP) or current is None or current <= 1 or gpus is None:
        return
    pick = max(d for d in range(1, current + 1) if gpus % d == 0 and _heads_ok(state.arch, d))
    reason = f"the largest size up to {current} that divides {gpus} GPUs{_heads_clause(state.arch)}"
    state.change(ACTOR_SP, pick, reason)
    if state.owned(REF_SP) and state.value(REF_SP) == current:
        state.change(REF_SP, pick, reason + " (the same as the actor's)")


def _rollout_tp(state: _Adaptation) -> None:
    current, gpn = state.value(ROLLOUT_TP), state.value(GPU_KEYS[0][0])
    if not state.owned(ROLLOUT_TP) or current is None or gpn is None:
        return
    valid = [d for d in divisors(gpn) if rollout_tp_ok(state.view, state.arch, d)]
    if current not in valid:
        pick = max([d for d in valid if d <= current] or [1])
        state.change(
            ROLLOUT_TP,
            pick,
            f"the largest TP up to {current} that divides {gpn} GPUs per node{_heads_clause(state.arch)}",
        )


def _train_batch(state: _Adaptation) -> None:
    current, n, gpus = state.value(TRAIN_BATCH), state.value(ROLLOUT_N), state.gpus
    if not state.owned(TRAIN_BATCH) or current is None or n is None or gpus is None:
        return
    steps = sync_steps(state.view) or 1
    mini = state.value(ACTOR_MINI) if not state.owned(ACTOR_MINI) else None

    def ok(b: int) -> bool:
        return (b * n) % gpus == 0 and b % steps == 0 and (mini is None or b >= mini)

    found = [] if ok(current) else nearest(current, ok)
    if not found:
        return  # nothing near fits: the batch rules report it with their fixes
    pick = found[0]
    state.change(
        TRAIN_BATCH,
        pick,
        f"{current} prompts × rollout.n {n} = {current * n} trajectories do not split evenly over "
        f"{gpus} GPUs; {pick} × {n} = {pick * n} do (the nearest such size)",
    )


def _mini_batch(state: _Adaptation) -> None:
    current, n, batch = state.value(ACTOR_MINI), state.value(ROLLOUT_N), state.value(TRAIN_BATCH)
    dp = batch_plan(state.view).actor.dp
    if not state.owned(ACTOR_MINI) or None in (current, n, batch, dp):
        return
    assert current is not None and n is not None and batch is not None and dp is not None

    def ok(m: int) -> bool:
        return (m * n) % dp == 0 and m <= batch

    if ok(current):
        return
    found = nearest(current, ok, limit=batch)
    if found:
        pick = found[0]
        state.change(
            ACTOR_MINI,
            pick,
            f"{current} × rollout.n {n} = {current * n} trajectories do not split over {dp} data-parallel GPUs "
            f"(or exceed data.train_batch_size {batch}); {pick} × {n} = {pick * n} do (the nearest such size)",
        )


def _micro_divisors(state: _Adaptation) -> None:
    plan = batch_plan(state.view)
    wholes = (
        (ACTOR_MICRO, plan.mini_per_gpu, "per-GPU mini batch"),
        (LOGPROB_MICRO, plan.logprob_rows, "per-GPU log-prob batch"),
        (REF_MICRO, plan.ref_rows, "per-GPU ref log-prob batch"),
    )
    for key, whole, what in wholes:
        current = state.value(key)
        if state.owned(key) and whole and current and whole % current:
            pick = max(d for d in divisors(whole) if d <= current)
            state.change(
                key, pick, f"the largest micro batch up to {current} that divides the {what} ({whole})"
            )


def _fit_micro(state: _Adaptation, fit: bool) -> None:
    facts = state.profile.facts()
    owned = [key for key in MICRO_KEYS if state.owned(key) and state.value(key)]
    if facts.gpu_memory_gb is None or not owned:
        return
    ctx = RuleContext(state.view, state.arch, _critic_arch(state), facts)
    cap = None if fit else {key: value for key in owned if (value := state.value(key))}
    for knob in fit_knobs(ctx, cap=cap):
        current = state.value(knob.key)
        if knob.key not in owned or knob.value is None or current is None:
            continue
        if fit or knob.value < current:
            state.change(knob.key, knob.value, knob.reason)


# --- pre-flight findings ----------------------------------------------------------------------------------


def preset_findings(composed: Composed, profile: HardwareProfile) -> list[Finding]:
    """Info findings: the preset ``auto`` chose, and every value adapted to the hardware, with its reason."""
    findings: list[Finding] = []
    tool = composed.tool
    if tool.preset and tool.preset[0] == AUTO and _auto_counts(profile, composed.view):
        name, why = choose_auto(profile, composed.view)
        findings.append(Finding("preset-auto", Severity.INFO, (), f"preset=auto chose {name}: {why}"))
    for key, prov in composed.view.provenance.items():
        if prov.source.layer is not Layer.ADAPTED:
            continue
        earlier = [w for w in prov.history if w.source.layer is Layer.PRESET]
        sources = [(key, prov.value, prov.source)] + [(key, w.value, w.source) for w in earlier[-1:]]
        was = f" from {earlier[-1].value}" if earlier else ""
        name = (earlier[-1].source.name if earlier else None) or _preset_name(composed.view) or ""
        message = f"preset {name} adapted {key}{was} to {prov.value}"
        findings.append(Finding("preset-adapted", Severity.INFO, (key,), message, None, tuple(sources)))
    findings.extend(_cannot_fit(composed, profile))
    return findings


CANNOT_FIT = "preset-cannot-fit"
_MEMORY_ERRORS = ("memory-stage-out-of-memory", "rollout-weights-per-rank", "rollout-kv-below-max-model-len")


def _preset_name(view: ConfigView) -> str | None:
    for prov in view.provenance.values():
        layers = [prov.source] + [w.source for w in prov.history]
        for source in layers:
            if source.layer is Layer.PRESET and source.name:
                return source.name
    return None


def _user_set(view: ConfigView) -> Callable[[str], bool]:
    def chosen(key: str) -> bool:
        prov = view.prov(key)
        return prov is not None and prov.source.layer in _USER_LAYERS

    return chosen


def _cannot_fit(composed: Composed, profile: HardwareProfile) -> list[Finding]:
    """An error when the preset, adapted with every knob, still does not fit the GPUs: what is too big, why."""
    view, facts = composed.view, profile.facts()
    name = _preset_name(view)
    arch = load_architecture(view.get("actor_rollout_ref.model.path"))
    if name is None or arch is None or facts.gpu_memory_gb is None:
        return []
    ctx = RuleContext(view, arch, load_architecture(view.get("critic.model.path")), facts)
    blocking = [
        f for f in memory_findings(ctx) if f.severity is Severity.ERROR and f.rule_id in _MEMORY_ERRORS
    ]
    if not blocking:
        return []
    gpu, gpn = facts.gpu_memory_gb, pos_int(view.get(GPU_KEYS[0][0])) or 1
    nodes = pos_int(view.get(GPU_KEYS[1][0])) or 1
    tp = max(d for d in divisors(gpn) if _heads_ok(arch, d))
    weights = arch.params * 2 / tp / 2**30
    model = view.get("actor_rollout_ref.model.path")
    if weights >= gpu:
        why = (
            f"its bf16 weights alone need {weights:.1f} GiB per GPU at the largest rollout TP ({tp}) that divides "
            f"{gpn} GPUs per node{_heads_clause(arch)}, more than the {gpu:g} GiB of one GPU"
        )
    else:
        first = blocking[0]
        why = (
            f"{first.message.split(';')[0]}; tried: rollout TP up to {tp}, gpu_memory_utilization, gradient "
            "checkpointing, parameter and optimizer offload, FSDP2's CPU offload policy"
        )
    message = f"preset {name} cannot fit {model} on {nodes} × {gpn} × {gpu:g} GiB: {why}"
    fix = (
        "more or larger GPUs (hardware.gpus_per_node, hardware.nodes), a smaller model, or shorter sequences"
    )
    return [Finding(CANNOT_FIT, Severity.ERROR, (), message, fix)]


# --- the memory plan: rollout fraction, TP, offload, checkpointing ----------------------------------------

FSDP_CFG = "actor_rollout_ref.actor.fsdp_config"
CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing"
STRATEGY = "actor_rollout_ref.actor.strategy"
UTIL_STEPS = tuple(round(0.9 - 0.05 * i, 2) for i in range(15))  # 0.9 down to 0.2
FLOOR_UTIL = 0.2


@dataclass(frozen=True)
class _Rung:
    """One step of the OOM checklist: the knobs it turns and why."""

    changes: dict[str, Any]
    what: str


def _rungs(state: _Adaptation) -> list[_Rung]:
    rungs = [_Rung({}, "")]
    if state.view.get(CHECKPOINTING) is False and state.free(CHECKPOINTING):
        rungs.append(_Rung({CHECKPOINTING: True}, "gradient checkpointing keeps one layer input per layer"))
    rungs.append(
        _Rung(
            {f"{FSDP_CFG}.optimizer_offload": True}, "the optimizer states wait on the CPU outside the update"
        )
    )
    rungs.append(
        _Rung({f"{FSDP_CFG}.param_offload": True}, "the parameters wait on the CPU outside their stages")
    )
    rungs.append(
        _Rung(
            {STRATEGY: "fsdp2", f"{FSDP_CFG}.offload_policy": True},
            "FSDP2's CPU offload policy keeps every shard on the CPU, the update included",
        )
    )
    return rungs


def _ok(stage: StageEstimate, gpu: float) -> bool:
    """Fits with the margin and the upper band stays within the GPU."""
    return stage.verdict == "fits" and stage.high <= gpu


class _Trial:
    """A candidate config for the memory plan: the adaptation so far plus a set of knob values."""

    def __init__(self, state: _Adaptation, changes: dict[str, Any]) -> None:
        self.state = state
        self.changes = changes
        self.view = with_values(state.view, changes) if changes else state.view
        facts = state.profile.facts()
        self.gpu = facts.gpu_memory_gb or 0.0
        self.ctx = RuleContext(self.view, state.arch, _critic_arch(state), facts)

    def with_(self, more: dict[str, Any]) -> _Trial:
        return _Trial(self.state, {**self.changes, **more})

    def estimate(self) -> MemoryEstimate:
        return estimate_memory(self.ctx)

    def training_block(self) -> StageEstimate | None:
        """The first training stage that does not fit even at its smallest micro batch."""
        est = self.estimate()
        for stage in est.stages:
            if stage.name == "rollout":
                continue
            at = stage_at(self.ctx, stage.name)
            smallest = at(1) if at is not None else stage
            if not _ok(smallest, self.gpu):
                return smallest
        return None


def _critic_arch(state: _Adaptation) -> Architecture | None:
    return load_architecture(state.view.get("critic.model.path"))


def _memory_plan(state: _Adaptation) -> None:
    """Walk the OOM checklist until every stage fits: rollout memory fraction and TP, then offload, then FSDP2's
    CPU offload; record each knob with its reason (nothing fits: the pre-flight says preset-cannot-fit)."""
    if state.profile.facts().gpu_memory_gb is None or state.arch is None:
        return
    if estimate_memory(_Trial(state, {}).ctx).missing:
        return
    taken: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    last: tuple[dict[str, Any], dict[str, str]] | None = None
    why_not = ""
    block: StageEstimate | None = None
    for rung in _rungs(state):
        trial = _Trial(state, {k: v for k, v in {**taken, **rung.changes}.items() if state.free(k)})
        if rung.changes and block is not None and not _lowers(trial, block):
            continue  # this knob does not touch what blocks (offload does not shrink the update)
        taken = {**taken, **rung.changes}
        for key in rung.changes:
            reasons[key] = f"{rung.what}; {why_not}" if why_not else rung.what
        rollout = _rollout_plan(state, trial)
        block = trial.training_block()
        plan = {**trial.changes, **(rollout[0] if rollout else {})}
        last = (plan, {**reasons, **(rollout[1] if rollout else {})})
        if rollout is not None and block is None:
            break
        why_not = _why_not(trial, rollout, block)
    assert last is not None
    plan, why = last
    for key, value in plan.items():
        state.change(key, value, why.get(key, "the memory plan"), knob=True)


def _lowers(trial: _Trial, block: StageEstimate) -> bool:
    """Whether the trial lowers the blocking stage's peak at its smallest micro batch."""
    at = stage_at(trial.ctx, block.name)
    return at is not None and at(1).total < block.total - 0.05


def _why_not(
    trial: _Trial, rollout: tuple[dict[str, Any], dict[str, str]] | None, block: StageEstimate | None
) -> str:
    gpu = trial.gpu
    if block is not None:
        return (
            f"without it {block.name} needs ~{block.total:.1f} GiB per GPU (band up to {block.high:.1f}) of "
            f"{gpu:g} GiB even at micro batch 1"
        )
    stage = trial.estimate().stage("rollout")
    resident = stage.get("optimizer") + stage.get("gradients") if stage else 0.0
    return (
        f"without it the actor's optimizer states resident during rollout ({resident:.1f} GiB per GPU) leave "
        f"vLLM no memory fraction ≥ {FLOOR_UTIL} that holds the weights and one full sequence within {gpu:g} GiB"
    )


def _rollout_plan(state: _Adaptation, trial: _Trial) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The memory fraction and the smallest TP whose KV cache holds what the rollout needs, or None."""
    gpn = state.value(GPU_KEYS[0][0])
    if gpn is None:
        return None
    ok = [d for d in divisors(gpn) if rollout_tp_ok(state.view, state.arch, d)]
    tps = ok if state.free(ROLLOUT_TP) else []
    own = state.value(ROLLOUT_TP) or 1
    # the preset's TP when it fits, else the smallest larger one that does, else a smaller one
    tps = sorted(tps, key=lambda tp: (tp < own, tp if tp >= own else -tp)) or [own]
    current = trial.view.get(GPU_UTIL)
    preset_util = float(current) if isinstance(current, int | float) else 0.5
    utils = [preset_util]
    if state.free(GPU_UTIL):  # the preset's fraction, then lower ones, then higher ones as a last resort
        lower = [u for u in UTIL_STEPS if u < preset_util]
        utils += lower + [u for u in UTIL_STEPS if u > preset_util][::-1]
    mml = [None] + (
        [MAX_MODEL_LEN] if state.free(MAX_MODEL_LEN) and state.view.get(MAX_MODEL_LEN) is None else []
    )
    within, above = [u for u in utils if u <= preset_util], [u for u in utils if u > preset_util]
    for cap in mml:
        base, extra = trial, {}
        if cap is not None:
            seq = batch_plan(trial.view).max_seq_len
            if not seq:
                continue
            extra = {cap: seq}
            base = trial.with_(extra)
        # a higher fraction only when no TP fits at the preset's; a prompt's samples side by side in the KV
        # cache are preferred, one full sequence is required (less only slows the rollout down)
        for pool, group in ((within, True), (within, False), (above, True), (above, False)):
            for tp in tps:
                for util in pool:
                    cand = base.with_({ROLLOUT_TP: tp, GPU_UTIL: util})
                    found = _rollout_fits(state, cand, (tp, util, preset_util), extra, group)
                    if found:
                        return found
    return None


def _rollout_fits(
    state: _Adaptation,
    cand: _Trial,
    knobs: tuple[int, float, float],
    extra: dict[str, Any],
    group: bool,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    tp, util, preset_util = knobs
    est = cand.estimate()
    stage, facts = est.stage("rollout"), est.rollout
    if stage is None or facts is None or facts.capacity_tokens is None or not _ok(stage, cand.gpu):
        return None
    need, why = _kv_need(cand.view, facts.max_model_len, group)
    if facts.capacity_tokens < need:
        return None
    gpu = cand.gpu
    resident = stage.total - (facts.pool_bytes or 0) / 2**30
    pool = f"gpu_memory_utilization {util:g} × {gpu:g} GiB"
    preset_tp = pos_int(state.base.get(ROLLOUT_TP)) or 1
    which = "the smallest TP above the preset's" if tp > preset_tp else "the largest TP up to the preset's"
    tp_reason = (
        f"{which} that fits: {facts.weights_bytes / 2**30:.1f} GiB of weights per GPU leave the KV cache of "
        f"{pool} {facts.capacity_tokens} tokens ≥ {need} ({why}); it divides {state.value(GPU_KEYS[0][0])} "
        f"GPUs per node{_heads_clause(state.arch)}"
    )
    change = "lowered" if util < preset_util else "raised"
    util_reason = (
        f"{change} from {preset_util:g}: the rollout also holds {resident:.1f} GiB per GPU outside vLLM's pool "
        f"(the actor's resident training state, CUDA graphs, the process), so it peaks at {stage.total:.1f} GiB "
        f"(band up to {stage.high:.1f}) of {gpu:g} GiB"
        + (
            ", within the 10% margin"
            if util < preset_util
            else f"; at {preset_util:g} no TP holds {need} tokens"
        )
    )
    changes: dict[str, Any] = {ROLLOUT_TP: tp, GPU_UTIL: util, **extra}
    reasons = {ROLLOUT_TP: tp_reason, GPU_UTIL: util_reason}
    positions = state.arch.max_position_embeddings if state.arch else None
    for key, value in extra.items():
        reasons[key] = (
            f"null means the model's {positions} positions, more than the KV cache holds at any TP; sequences "
            f"here are at most {value} tokens (data.max_prompt_length + data.max_response_length)"
        )
    return changes, reasons


def _kv_need(view: ConfigView, max_len: int, samples: bool = True) -> tuple[int, str]:
    """Tokens the KV cache must hold: vLLM's longest sequence, and (``samples``) one prompt's samples at full
    length."""
    plan = batch_plan(view)
    group = (plan.n or 1) * (plan.max_seq_len or 0)
    if samples and group > max_len:
        return group, f"rollout.n {plan.n} × {plan.max_seq_len}-token sequences"
    return max_len, f"max_model_len {max_len}"

"""Presets: what each is meant for, which one ``auto`` picks, and their adaptation to the real hardware."""

from __future__ import annotations

import importlib
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
    sync_steps,
    with_values,
)

AUTO = "auto"
ACTOR_SP = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
REF_SP = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size"
GPU_UTIL = "actor_rollout_ref.rollout.gpu_memory_utilization"
MAX_MODEL_LEN = "actor_rollout_ref.rollout.max_model_len"
MICRO_KEYS = (ACTOR_MICRO, LOGPROB_MICRO, REF_MICRO)
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
        return compose(request)
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
    if not adapted:
        return first
    return compose(replace(request, adapted=request.adapted + adapted))


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
        self.changes: dict[str, tuple[int, str]] = {}
        self.view = view

    def owned(self, key: str) -> bool:
        prov = self.base.prov(key)
        return prov is not None and prov.source.layer is Layer.PRESET

    def value(self, key: str) -> int | None:
        return pos_int(self.view.get(key))

    def change(self, key: str, value: int, reason: str) -> None:
        if self.owned(key) and value != self.value(key):
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
    for step in (_gpu_counts, _ulysses, _rollout_tp, _train_batch, _mini_batch, _micro_divisors):
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
    valid = [d for d in divisors(gpn) if _heads_ok(state.arch, d)]
    sized = _tp_for_memory(state, valid)
    if sized is not None:
        state.change(ROLLOUT_TP, *sized)
    elif current not in valid:
        pick = max([d for d in valid if d <= current] or [1])
        state.change(
            ROLLOUT_TP,
            pick,
            f"the largest TP up to {current} that divides {gpn} GPUs per node{_heads_clause(state.arch)}",
        )


def _tp_for_memory(state: _Adaptation, valid: list[int]) -> tuple[int, str] | None:
    memory, arch, util = state.profile.facts().gpu_memory_gb, state.arch, state.view.get(GPU_UTIL)
    if memory is None or arch is None or not isinstance(util, int | float) or not valid:
        return None
    budget = float(util) * memory
    need, why = _kv_need(state, arch)
    where = f"the rollout's {budget:.1f} GiB (gpu_memory_utilization {util} × {memory:g} GiB)"
    divides = f"divides {state.value(GPU_KEYS[0][0])} GPUs per node{_heads_clause(arch)}"
    for tp in valid:
        weights = arch.params * 2 / tp / 2**30
        per_token = 2 * arch.num_hidden_layers * max(arch.num_key_value_heads // tp, 1) * arch.head_dim * 2
        tokens = int((budget - weights) * 2**30 / per_token)
        if tokens >= need:
            return tp, (
                f"smallest TP that fits: {weights:.1f} GiB of weights per GPU leave {budget - weights:.1f} GiB "
                f"of {where} for the KV cache, {tokens} tokens ≥ {need} ({why}); {divides}"
            )
    return valid[
        -1
    ], f"no TP leaves KV cache for {need} tokens ({why}) in {where}; the largest that {divides}"


def _kv_need(state: _Adaptation, arch: Architecture) -> tuple[int, str]:
    """Tokens the KV cache must hold: vLLM's longest sequence, and one prompt's samples at full length."""
    max_len = pos_int(state.view.get(MAX_MODEL_LEN))
    longest = max_len or arch.max_position_embeddings
    longest_why = (
        f"max_model_len {max_len}" if max_len else f"max_model_len null: the model's {longest} positions"
    )
    plan = batch_plan(state.view)
    group = (plan.n or 1) * (plan.max_seq_len or 0)
    if group > longest:
        return group, f"rollout.n {plan.n} × {plan.max_seq_len}-token sequences"
    return longest, longest_why


def _train_batch(state: _Adaptation) -> None:
    current, n, gpus = state.value(TRAIN_BATCH), state.value(ROLLOUT_N), state.gpus
    if not state.owned(TRAIN_BATCH) or current is None or n is None or gpus is None:
        return
    steps = sync_steps(state.view) or 1
    mini = state.value(ACTOR_MINI) if not state.owned(ACTOR_MINI) else None

    def ok(b: int) -> bool:
        return (b * n) % gpus == 0 and b % steps == 0 and (mini is None or b >= mini)

    if ok(current):
        return
    pick = nearest(current, ok)[0]
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
    try:
        fit_knobs = importlib.import_module("verl_safe_launch.memory.fit").fit_knobs
    except ImportError:
        return
    critic = load_architecture(state.view.get("critic.model.path"))
    ctx = RuleContext(state.view, state.arch, critic, facts)
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
        name = (earlier[-1].source.name if earlier else None) or ""
        message = f"preset {name} adapted {key}{was} to {prov.value}"
        findings.append(Finding("preset-adapted", Severity.INFO, (key,), message, None, tuple(sources)))
    return findings

"""What the pre-flight says of a preset: the choice of ``auto``, every adapted value, and a preset that cannot fit."""

from __future__ import annotations

from verl_safe_launch.compose import Composed
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import GPU_KEYS, HardwareProfile, load_architecture
from verl_safe_launch.memory import memory_findings
from verl_safe_launch.presets.catalog import AUTO, auto_counts, choose_auto
from verl_safe_launch.presets.state import heads_clause
from verl_safe_launch.provenance import Layer
from verl_safe_launch.rules import divisors, pos_int, rollout_tp_ok


def preset_findings(composed: Composed, profile: HardwareProfile) -> list[Finding]:
    """Info findings: the preset ``auto`` chose, and every value adapted to the hardware, with its reason."""
    findings: list[Finding] = []
    tool = composed.tool
    if tool.preset and tool.preset[0] == AUTO and auto_counts(profile, composed.view):
        name, why = choose_auto(profile, composed.view)
        findings.append(Finding("preset-auto", Severity.INFO, (), f"preset=auto chose {name}: {why}"))
    for key, prov in composed.view.provenance.items():
        if prov.source.layer is not Layer.ADAPTED:
            continue
        earlier = [w for w in prov.history if w.source.layer is Layer.PRESET]
        sources = [(key, prov.value, prov.source)] + [(key, w.value, w.source) for w in earlier[-1:]]
        was = f" from {earlier[-1].value}" if earlier else ""
        name = (earlier[-1].source.name if earlier else None) or preset_name(composed.view) or ""
        message = f"preset {name} adapted {key}{was} to {prov.value}"
        findings.append(Finding("preset-adapted", Severity.INFO, (key,), message, None, tuple(sources)))
    findings.extend(_cannot_fit(composed, profile))
    return findings


CANNOT_FIT = "preset-cannot-fit"


_MEMORY_ERRORS = ("memory-stage-out-of-memory", "rollout-weights-per-rank", "rollout-kv-below-max-model-len")


def preset_name(view: ConfigView) -> str | None:
    for prov in view.provenance.values():
        layers = [prov.source] + [w.source for w in prov.history]
        for source in layers:
            if source.layer is Layer.PRESET and source.name:
                return source.name
    return None


def _cannot_fit(composed: Composed, profile: HardwareProfile) -> list[Finding]:
    """An error when the preset, adapted with every knob, still does not fit the GPUs: what is too big, why."""
    view, facts = composed.view, profile.facts()
    name = preset_name(view)
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
    tp = max(d for d in divisors(gpn) if rollout_tp_ok(view, arch, d))
    weights = arch.params * 2 / tp / 2**30
    model = view.get("actor_rollout_ref.model.path")
    if weights >= gpu:
        why = (
            f"its bf16 weights alone need {weights:.1f} GiB per GPU at the largest rollout TP ({tp}) that divides "
            f"{gpn} GPUs per node{heads_clause(arch)}, more than the {gpu:g} GiB of one GPU"
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

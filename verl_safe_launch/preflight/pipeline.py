"""The pre-flight pipeline: composed config → audit → rules → memory, all findings collected in one pass."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from verl_safe_launch.audit import audit
from verl_safe_launch.compose import Composed, resolution_findings, structure_findings
from verl_safe_launch.context import Architecture, HardwareFacts, RuleContext
from verl_safe_launch.findings import Finding, has_errors
from verl_safe_launch.inputs import (
    HardwareProfile,
    as_profile,
    detect_hardware,
    hardware_findings,
    load_architecture,
)
from verl_safe_launch.memory import fit_knobs, memory_findings
from verl_safe_launch.preflight.recheck import rechecked
from verl_safe_launch.presets import preset_findings
from verl_safe_launch.rules import run_rules


@dataclass(frozen=True)
class Preflight:
    """The outcome of the pre-flight: every finding, plus what the stages knew."""

    composed: Composed
    findings: tuple[Finding, ...]
    context: RuleContext
    extras: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing blocks the launch."""
        return not has_errors(self.findings)


def hardware_from_tokens(composed: Composed) -> HardwareFacts:
    """Hardware facts: ``hardware.*`` tokens, then a Slurm allocation, then nvidia-smi."""
    return detect_hardware(composed.tool).facts()


def rule_context(composed: Composed, hardware: HardwareFacts | None = None) -> RuleContext:
    """The read-only context every rule sees."""
    view = composed.view
    actor: Architecture | None = load_architecture(view.get("actor_rollout_ref.model.path"))
    critic: Architecture | None = load_architecture(view.get("critic.model.path"))
    return RuleContext(view, actor, critic, hardware or hardware_from_tokens(composed))


def run_preflight(composed: Composed, hardware: HardwareFacts | HardwareProfile | None = None) -> Preflight:
    """Run every pre-flight stage on a composed config and collect all findings."""
    profile = as_profile(composed.tool, hardware)
    ctx = rule_context(composed, profile.facts())
    findings: list[Finding] = [
        *structure_findings(composed),
        *resolution_findings(composed, profile.allocation_for),
    ]
    findings.extend(audit(composed))
    findings.extend(preset_findings(composed, profile))
    findings.extend(hardware_findings(composed.view, profile))
    findings.extend(with_fitted_maximum(run_rules(ctx), ctx))
    findings.extend(memory_findings(ctx))
    return Preflight(composed, tuple(rechecked(findings, ctx)), ctx)


def launch_preflight(composed: Composed, verb: str, profile: HardwareProfile | None = None) -> Preflight:
    """The pre-flight of a verb that starts (or joins) Ray itself, with its own CPU count: ``run``, ``submit``..."""
    hardware = replace(profile or detect_hardware(composed.tool), ray_by=f"verl-safe-launch {verb}")
    return run_preflight(composed, hardware)


def with_fitted_maximum(findings: list[Finding], ctx: RuleContext) -> list[Finding]:
    """An unset micro batch's fix gives a safe start; add the memory fit's maximum (what ``--fit`` would set)."""
    unset = [f for f in findings if f.rule_id.endswith("-micro-keys") and f.fix and f.keys]
    if not unset or ctx.hardware.gpu_memory_gb is None or ctx.actor_arch is None:
        return findings
    fits = {k.key: k for k in fit_knobs(ctx) if k.value is not None}
    out = []
    for finding in findings:
        fit = fits.get(finding.keys[0]) if finding in unset else None
        if fit is not None and finding.fix:
            fix = f"{finding.fix}; the memory fit allows up to {fit.value} ('check --fit' sets it: {fit.reason})"
            finding = replace(finding, fix=fix)
        out.append(finding)
    return out

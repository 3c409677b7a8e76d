"""The pre-flight pipeline: composed config → audit → rules → memory, all findings collected in one pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_safe_launch.architecture import Architecture, load_architecture
from verl_safe_launch.compose import Composed
from verl_safe_launch.findings import Finding, has_errors
from verl_safe_launch.rules import HardwareFacts, RuleContext, run_rules


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
    """Hardware facts from explicit ``hardware.*`` tokens only."""
    hw = composed.tool.hardware

    def num(name: str) -> float | None:
        return float(hw[name][0]) if name in hw else None

    nodes, gpus, mem = num("nodes"), num("gpus_per_node"), num("gpu_memory_gb")
    return HardwareFacts(
        nodes=int(nodes) if nodes is not None else None,
        gpus_per_node=int(gpus) if gpus is not None else None,
        gpu_memory_gb=mem,
        gpu_name=hw["gpu_name"][0] if "gpu_name" in hw else None,
    )


def rule_context(composed: Composed, hardware: HardwareFacts | None = None) -> RuleContext:
    """The read-only context every rule sees."""
    view = composed.view
    actor: Architecture | None = load_architecture(view.get("actor_rollout_ref.model.path"))
    critic: Architecture | None = load_architecture(view.get("critic.model.path"))
    return RuleContext(view, actor, critic, hardware or hardware_from_tokens(composed))


def run_preflight(composed: Composed, hardware: HardwareFacts | None = None) -> Preflight:
    """Run every pre-flight stage on a composed config and collect all findings."""
    ctx = rule_context(composed, hardware)
    findings: list[Finding] = []
    findings.extend(run_rules(ctx))
    return Preflight(composed, tuple(findings), ctx)

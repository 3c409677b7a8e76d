"""Host RAM per node: offloaded shards, checkpoint save buffers, Ray's object store, dataloader and processes."""

from __future__ import annotations

from dataclasses import dataclass

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.memory.engine import Engine
from verl_safe_launch.memory.terms import GIB

RAY_STORE_FRACTION = (
    0.3  # Ray's default object store: 30% of the node's memory (shared memory, used as needed)
)
RAY_STORE_KEY = "ray_kwargs.ray_init.object_store_memory"
PROCESS_GIB = 2.0  # one Ray worker process: Python, torch, verl and the CUDA context's host side
DATALOADER_WORKER_GIB = 0.5  # one dataloader worker process (a forked copy of the dataset and tokenizer)
HOST_MARGIN = 0.10
COMPONENTS = (
    "offloaded parameters",
    "offloaded gradients",
    "offloaded optimizer",
    "ref parameters",
    "checkpoint save buffers",
    "Ray object store",
    "dataloader workers",
    "worker processes",
)


@dataclass(frozen=True)
class HostEstimate:
    """Host RAM one node needs at its peak (GiB per component) and the node's memory when known."""

    components: tuple[tuple[str, float], ...]
    gpus_per_node: int
    host_memory_gib: float | None
    assumptions: tuple[str, ...]

    @property
    def total(self) -> float:
        """The estimated peak in GiB."""
        return sum(v for _, v in self.components)

    def get(self, component: str) -> float:
        """GiB of one component (0 when absent)."""
        return dict(self.components).get(component, 0.0)


def _shards(engine: Engine, per_node: int) -> dict[str, float]:
    """Host bytes of one engine's shards that live on the CPU, for the GPUs of one node."""
    shard = engine.params * engine.dtype_bytes / engine.shards * per_node
    trainable = engine.trainable * engine.dtype_bytes / engine.shards * per_node
    if engine.forward_only:
        return {"ref parameters": engine.params * 2 / engine.shards * per_node} if engine.cpu_policy else {}
    out: dict[str, float] = {}
    if engine.param_offload or engine.cpu_policy:
        out["offloaded parameters"] = shard
        out["offloaded gradients"] = trainable if engine.cpu_policy else 0.0
    if engine.optimizer_offload or engine.cpu_policy:
        out["offloaded optimizer"] = 2 * trainable
    return out


def _checkpoint(view: ConfigView, engine: Engine, per_node: int) -> float:
    """A save copies the model shard to host memory (and the optimizer states still on the GPU)."""
    freq = view.get("trainer.save_freq")
    if not isinstance(freq, int) or freq <= 0:
        return 0.0
    params = engine.params * engine.dtype_bytes / engine.shards * per_node
    optimizer = 0.0 if engine.optimizer_offload else 2 * engine.trainable * engine.dtype_bytes / engine.shards
    return params + optimizer * per_node


def host_estimate(
    view: ConfigView, engines: tuple[Engine, ...], per_node: int, host_gib: float | None
) -> HostEstimate:
    """Per-node host RAM of the training engines (actor, ref, critic) plus Ray and the dataloader."""
    parts: dict[str, float] = {}
    for engine in engines:
        for key, value in _shards(engine, per_node).items():
            parts[key] = parts.get(key, 0.0) + value
    actor = engines[0]
    parts["checkpoint save buffers"] = _checkpoint(view, actor, per_node)
    store = view.get(RAY_STORE_KEY)
    lines = []
    if isinstance(store, int) and store > 0:
        parts["Ray object store"] = float(store)
        lines.append(f"Ray object store {store / GIB:.1f} GiB ({RAY_STORE_KEY})")
    elif host_gib is not None:
        parts["Ray object store"] = RAY_STORE_FRACTION * host_gib * GIB
        lines.append(f"Ray object store: Ray's default {RAY_STORE_FRACTION:.0%} of host memory, reserved")
    workers = view.get("data.dataloader_num_workers")
    count = workers if isinstance(workers, int) and workers > 0 else 0
    parts["dataloader workers"] = count * DATALOADER_WORKER_GIB * GIB
    parts["worker processes"] = per_node * PROCESS_GIB * GIB
    lines += [
        f"host RAM per node of {per_node} GPUs: offloaded shards as on the GPU (fp32 unless model_dtype says), "
        "the ref model's bf16 shards (verl keeps forward-only engines on the CPU)",
        f"{PROCESS_GIB:g} GiB per worker process, {DATALOADER_WORKER_GIB:g} GiB per dataloader worker "
        "(data.dataloader_num_workers); a checkpoint save (trainer.save_freq > 0) copies the model shard to "
        "host memory",
    ]
    gib = tuple((c, parts[c] / GIB) for c in COMPONENTS if parts.get(c, 0.0) > 0)
    return HostEstimate(gib, per_node, host_gib, tuple(lines))


HOST_OOM, HOST_TIGHT = "host-memory-out-of-memory", "host-memory-tight"
HOST_FIXES = {
    "offloaded optimizer": "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
    "offloaded parameters": "actor_rollout_ref.actor.fsdp_config.param_offload=false",
    "checkpoint save buffers": "a larger trainer.save_freq, or more host memory (sbatch --mem)",
    "Ray object store": f"+{RAY_STORE_KEY}=<bytes> (Ray's default is {RAY_STORE_FRACTION:.0%} of host memory)",
    "dataloader workers": "data.dataloader_num_workers=2",
}


def host_findings(host: HostEstimate | None, source: str | None = None) -> list[Finding]:
    """An error when a node's host RAM cannot hold the estimate, a warning within the margin; ``source`` says
    where the host memory figure came from."""
    if host is None or host.host_memory_gib is None:
        return []
    limit = host.host_memory_gib
    if host.total * (1 + HOST_MARGIN) <= limit:
        return []
    parts = ", ".join(f"{c} {v:.1f}" for c, v in sorted(host.components, key=lambda c: -c[1]) if v >= 0.05)
    oom = host.total > limit
    msg = (
        f"host RAM per node needs ~{host.total:.1f} GiB ({parts}) of {limit:g} GiB "
        f"({source or 'hardware.host_memory_gb'})"
        + ("" if oom else f"; less than the {HOST_MARGIN:.0%} margin left")
    )
    top = max(host.components, key=lambda c: c[1])[0]
    fix = HOST_FIXES.get(top, "more host memory per node (sbatch --mem), or more nodes")
    rule, severity = (HOST_OOM, Severity.ERROR) if oom else (HOST_TIGHT, Severity.WARNING)
    return [Finding(rule, severity, (), msg, fix)]

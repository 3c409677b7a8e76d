"""``oom`` with the log alone (no config): the checklist ranked by what the log's own numbers say each change frees.

Without the run's config the values that failed are unknown, so no override can be pasted: each item names the knob
and the change (halve it, switch it on), and the memory it frees is read from torch's message where the message
tells it (the allocation that failed grows with the micro batch's tokens; memory reserved but not allocated is what
expandable segments give back). Items the log cannot size come last, saying what would size them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_safe_launch.doctor.oom_doctor import Diagnosis, Remedy, measured_gib
from verl_safe_launch.doctor.oom_log import HOST, KV_CACHE, RAY_TASK_KIND, ROLLOUT, WAKE_UP, OomEvent
from verl_safe_launch.doctor.oom_remedies import ALLOC_CONF, EXPANDABLE, role_of
from verl_safe_launch.doctor.postmortem import ESTIMATOR_STAGE
from verl_safe_launch.doctor.report import UNSIZED

ARR = "actor_rollout_ref"
MICRO = {
    "old log-prob": f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu",
    "ref log-prob": f"{ARR}.ref.log_prob_micro_batch_size_per_gpu",
    "actor update": f"{ARR}.actor.ppo_micro_batch_size_per_gpu",
    "critic": "critic.ppo_infer_max_token_len_per_gpu",  # the V1 critic runs on token budgets
}
UTIL = f"{ARR}.rollout.gpu_memory_utilization"
CHUNKING = f"{ARR}.actor.fsdp_config.entropy_from_logits_with_chunking"
WITH_CONFIG = "for values to paste, checked against the run's config: verl-safe-launch oom LOG -c CONFIG (and the run's overrides)"


def diagnose_log_only(event: OomEvent, record: Mapping[str, Any] | None = None) -> Diagnosis:
    """The stage, its knob, and the checklist the log's numbers rank (no values: the config is unknown)."""
    name = ESTIMATOR_STAGE.get(event.stage or "", ROLLOUT if event.stage == ROLLOUT else "")
    notes = ["no config given: the checklist is ranked from the log alone; " + WITH_CONFIG]
    if event.kind == RAY_TASK_KIND:
        notes.append("torch's message is in the worker's log: pass the run directory to measure the failure")
    if event.own_pid is not None:
        notes.append(
            f"process {event.own_pid} in torch's list is the failing process itself ({event.in_use_gib:g} GiB in "
            "use; torch lists it by the driver's process id, as inside a container)"
        )
    if event.other_process_gib > (event.in_use_gib or 0.0):
        fix = (
            f"other processes hold {event.other_process_gib:g} GiB of this GPU: stop them or run elsewhere; "
            "shrinking this run's batches would not help"
        )
        return Diagnosis(event, name or None, None, None, None, 1.0, (), tuple(notes), fix, pastable=False)
    if event.kind in (KV_CACHE, WAKE_UP):
        rollout = _rollout_items(event)
        return Diagnosis(event, ROLLOUT, UTIL, None, None, 1.0, rollout, tuple(notes), pastable=False)
    if event.kind == HOST or not name:
        return Diagnosis(
            event, name or None, None, None, None, 1.0, _host_items(name), tuple(notes), pastable=False
        )
    needed = measured_gib(event, record)
    items = [*_sized(event, name, needed), *_unsized(event, name)]
    knob = MICRO.get(name)
    return Diagnosis(event, name, knob, None, None, 1.0, tuple(items), tuple(notes), pastable=False)


def _sized(event: OomEvent, name: str, needed: float | None) -> list[Remedy]:
    """Items the log sizes: the failed allocation grows with the micro batch's tokens; fragmentation is measured."""
    out: list[Remedy] = []
    tried, peak = event.tried_gib, needed or 0.0
    if tried:
        half = tried / 2
        if event.in_entropy and name != "ref log-prob":
            why = "the entropy over the full-vocabulary logits is computed in chunks (the failed allocation's size)"
            out.append(Remedy((f"{CHUNKING}=true",), tried, peak - tried, why))
        knob = MICRO.get(name)
        if knob:
            what = "halve the token budget" if "max_token_len" in knob else "halve the micro batch"
            why = f"{what}: the allocation that failed ({tried:g} GiB) grows with the micro batch's tokens"
            out.append(Remedy((f"{knob}: {what.split()[0]} it",), half, peak - half, why))
        why = "halve the response length: fewer tokens per sequence in every micro batch (changes what is trained)"
        out.append(Remedy(("data.max_response_length: halve it",), half, peak - half, why))
    if event.unallocated_gib:
        gib = event.unallocated_gib
        why = (
            f"PyTorch held {gib:g} GiB reserved but unallocated: fragmentation; expandable segments reuse it"
        )
        out.append(Remedy((f"+{ALLOC_CONF}={EXPANDABLE}",), gib, peak - gib, why))
    return sorted(out, key=lambda r: -r.freed_gib)


def _unsized(event: OomEvent, name: str) -> list[Remedy]:
    """Items whose effect depends on the model and the config: named, last."""
    role = role_of(name)
    out: list[Remedy] = []
    if role.dynamic is not None:
        switch, budget = role.dynamic
        why = (
            "a token budget instead of a count of sequences: short responses stop costing a full-length slot"
        )
        out.append(
            Remedy((f"{switch}=true", f"{budget}: about the failed batch's tokens"), UNSIZED, 0.0, why)
        )
    for whose, keys in role.offloads:
        why = f"keep {whose} parameters and optimizer in CPU memory (their size depends on the model)"
        out.append(Remedy(tuple(f"{key}=true" for key in keys), UNSIZED, 0.0, why))
    return out


def _rollout_items(event: OomEvent) -> tuple[Remedy, ...]:
    length = Remedy(
        (f"{ARR}.rollout.max_model_len: the prompt + response length",),
        UNSIZED,
        0.0,
        "a KV cache sized for the run's sequences, not the model's full context",
    )
    if event.kind == KV_CACHE:
        why = "the engine's share of the GPU holds too small a KV cache for one sequence of max_model_len"
        return (length, Remedy((f"{UTIL}: raise it",), UNSIZED, 0.0, why))
    why = "the engine's share of the GPU and what the trainer still holds do not fit the GPU together"
    offload = Remedy(
        tuple(f"{key}=true" for key in role_of("actor update").offloads[0][1]),
        UNSIZED,
        0.0,
        "the actor's parameters and optimizer leave the GPU while the engine is awake",
    )
    return (Remedy((f"{UTIL}: lower it",), UNSIZED, 0.0, why), offload)


def _host_items(name: str) -> tuple[Remedy, ...]:
    why = "fewer dataloader processes in host memory"
    return (Remedy(("data.dataloader_num_workers: lower it",), UNSIZED, 0.0, why),)


__all__ = ["WITH_CONFIG", "diagnose_log_only"]

"""The batch arithmetic walked step by step: each line a value, its formula with numbers, and its keys."""

from __future__ import annotations

from dataclasses import dataclass

from verl_safe_launch.config_view import ARR, ConfigView
from verl_safe_launch.rules import plan as b
from verl_safe_launch.rules.plan import BatchPlan, RoleLayout


@dataclass(frozen=True)
class Step:
    """One line of the walk: a stable id, what it is, its value (None: not a whole number or unknown)."""

    step_id: str
    label: str
    value: int | None
    formula: str
    keys: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        """Stable JSON form."""
        return {
            "id": self.step_id,
            "label": self.label,
            "value": self.value,
            "formula": self.formula,
            "keys": list(self.keys),
        }


def ratio(a: int | None, a_unit: str, c: int | None, c_unit: str) -> str:
    """``720 sequences / 6 ranks``, plus why the result is missing when it is."""
    text = f"{a} {a_unit} / {c} {c_unit}".replace("  ", " ").strip()
    if a is None or c is None:
        return f"{text} (unknown)"
    if c and a % c:
        return f"{text} = {a / c:.4g}: not a whole number"
    return text


def dp_step(layout: RoleLayout, label: str) -> Step:
    """Data-parallel size of one role."""
    step_id = f"dp_{layout.role}"
    if layout.engine == "megatron" and layout.dynamic_cp:
        return Step(step_id, label, 1, "1 (dynamic context parallel)", layout.keys)
    if layout.engine == "megatron":
        split = f"(tensor {layout.tp} × pipeline {layout.pp} × context {layout.cp} parallel)"
        return Step(
            step_id, label, layout.dp, ratio(layout.gpus, "GPUs", layout.model_parallel, split), layout.keys
        )
    if layout.engine == "fsdp":
        return Step(
            step_id, label, layout.dp, ratio(layout.gpus, "GPUs", layout.sp, "(Ulysses)"), layout.keys
        )
    return Step(step_id, label, None, f"engine '{layout.engine}' is not modelled", layout.keys)


def explain(view: ConfigView) -> list[Step]:
    """Every step of the arithmetic for this config, in the order a reader needs them."""
    p = b.batch_plan(view)
    return [*_sizes(p), *_parallel(p), *_rollout(p), *_update(view, p), *_padding(p), *_scoring(view, p)]


def _sizes(p: BatchPlan) -> list[Step]:
    return [
        Step("prompts", "prompts per step", p.prompts, f"train_batch_size {p.prompts}", (b.TRAIN_BATCH,)),
        Step(
            "sequences",
            "sequences per step",
            p.trajectories,
            f"{p.prompts} prompts × {p.n} (rollout.n)",
            (b.TRAIN_BATCH, b.ROLLOUT_N),
        ),
        Step(
            "gpus",
            "GPUs (trainer pool)",
            p.gpus,
            f"{p.gpus_per_node} GPUs per node × {p.nnodes} node{'' if p.nnodes == 1 else 's'}",
            (b.GPUS_PER_NODE, b.NNODES),
        ),
    ]


def _parallel(p: BatchPlan) -> list[Step]:
    steps = [dp_step(p.actor, "data-parallel size, actor")]
    if p.use_ref:
        steps.append(dp_step(p.ref, "data-parallel size, reference"))
    if p.use_critic:
        steps.append(dp_step(p.critic, "data-parallel size, critic"))
    return steps


def _rollout(p: BatchPlan) -> list[Step]:
    keys = (b.ROLLOUT_TP, b.ROLLOUT_DP, b.ROLLOUT_PP)
    world = f"tensor {p.rollout_tp} × data {p.rollout_dp} × pipeline {p.rollout_pp} parallel"
    return [
        Step("rollout_world", "GPUs per rollout replica", p.rollout_world, world, keys),
        Step(
            "replicas",
            "rollout replicas",
            p.replicas,
            ratio(p.rollout_gpus, "GPUs", p.rollout_world, "GPUs per replica"),
            (*keys, b.GPUS_PER_NODE, b.NNODES),
        ),
        Step(
            "prompts_per_replica",
            "prompts per replica",
            p.prompts_per_replica,
            ratio(p.prompts, "prompts", p.replicas, "replicas"),
            (b.TRAIN_BATCH,),
        ),
        Step(
            "sequences_per_replica",
            "sequences per replica",
            p.sequences_per_replica,
            ratio(p.trajectories, "sequences", p.replicas, "replicas"),
            (b.TRAIN_BATCH, b.ROLLOUT_N),
        ),
    ]


def _update(view: ConfigView, p: BatchPlan) -> list[Step]:
    rank = "GPU" if (p.actor.model_parallel or 1) == 1 else "data-parallel rank"
    steps = [
        Step(
            "mini_trajectories",
            "actor mini batch (trajectories)",
            p.mini_trajectories,
            f"{p.mini} prompts (ppo_mini_batch_size) × {p.n} (rollout.n)",
            (b.ACTOR_MINI, b.ROLLOUT_N),
        ),
        Step(
            "mini_per_gpu",
            f"mini batch per {rank} (trajectories)",
            p.mini_per_gpu,
            ratio(p.mini_trajectories, "trajectories", p.actor.dp, "data-parallel ranks"),
            (b.ACTOR_MINI, b.ROLLOUT_N, *p.actor.keys),
        ),
    ]
    if p.dynamic:
        budget = view.get(f"{ARR}.actor.ppo_max_token_len_per_gpu")
        text = f"dynamic batch size: micro batches packed up to {budget} tokens per GPU"
        steps.append(Step("grad_accum", "micro batches per mini batch", None, text, (b.ACTOR_DYNAMIC,)))
    else:
        formula = ratio(p.mini_per_gpu, "trajectories", p.micro, "(ppo_micro_batch_size_per_gpu)")
        steps.append(
            Step(
                "grad_accum",
                "micro batches per mini batch (grad accumulation)",
                p.grad_accum,
                formula,
                (b.ACTOR_MICRO,),
            )
        )
    steps.append(_optimizer_steps(p))
    if p.use_critic:
        steps.append(_critic_mini(p))
    return steps


def _optimizer_steps(p: BatchPlan) -> Step:
    sync = f"{p.sync_steps} local updates × " if (p.sync_steps or 1) > 1 else ""
    batches = ratio(p.padded, "padded", p.mini_trajectories, "per mini batch")
    formula = f"{sync}{p.ppo_epochs} (ppo_epochs) × {p.mini_batches} mini batches ({batches})"
    return Step(
        "optimizer_steps",
        "optimizer steps per training step",
        p.optimizer_steps,
        formula,
        (b.PPO_EPOCHS, b.ACTOR_MINI),
    )


def _critic_mini(p: BatchPlan) -> Step:
    formula = (
        f"{p.critic_mini} prompts (critic.ppo_mini_batch_size) × {p.n} (rollout.n) = "
        f"{ratio(p.critic_mini_trajectories, 'trajectories', p.critic.dp, 'data-parallel ranks')}"
    )
    return Step(
        "critic_mini_per_gpu",
        "critic mini batch per rank (trajectories)",
        p.critic_mini_per_gpu,
        formula,
        (b.CRITIC_MINI, b.ROLLOUT_N),
    )


def _padding(p: BatchPlan) -> list[Step]:
    if not p.v1:
        return [
            Step("padded", "scored batch (legacy trainer: no padding)", p.padded, f"{p.padded} sequences", ())
        ]
    parts = [f"actor dp {p.actor.dp}", f"actor mini batch {p.mini_trajectories}"]
    if p.use_critic:
        parts.append(f"critic mini batch {p.critic_mini_trajectories}")
    keys = (b.ACTOR_MINI, b.ROLLOUT_N, *p.actor.keys, *((b.CRITIC_MINI,) if p.use_critic else ()))
    step_text = f"{p.step_trajectories} sequences" + (
        f" per local update (÷ {p.sync_steps})" if (p.sync_steps or 1) > 1 else ""
    )
    padded = f"{step_text} rounded up to a multiple of {p.pad_multiple} ({p.padding} no-op padding sequences)"
    return [
        Step(
            "pad_multiple",
            "V1 padding multiple",
            p.pad_multiple,
            f"lcm({', '.join(parts)})",
            keys,
        ),
        Step("padded", "padded batch", p.padded, padded, (b.TRAIN_BATCH, b.ROLLOUT_N)),
    ]


def _scoring(view: ConfigView, p: BatchPlan) -> list[Step]:
    steps = _scoring_pass(
        p, "logprob", "old log-prob", p.actor, p.logprob_rows, p.logprob_micro, b.LOGPROB_MICRO, p.dynamic
    )
    if p.use_ref:
        steps += _scoring_pass(
            p, "ref", "reference log-prob", p.ref, p.ref_rows, p.ref_micro, b.REF_MICRO, p.ref_dynamic
        )
    return steps


def _scoring_pass(
    p: BatchPlan,
    name: str,
    stage: str,
    layout: RoleLayout,
    rows: int | None,
    micro: int | None,
    key: str,
    dynamic: bool,
) -> list[Step]:
    rows_step = Step(
        f"{name}_rows",
        f"{stage}: sequences per rank",
        rows,
        ratio(p.padded, "padded sequences", layout.dp, "data-parallel ranks"),
        layout.keys,
    )
    if dynamic:
        text = "dynamic batch size: micro batches packed by token budget"
        return [
            rows_step,
            Step(f"{name}_micro_batches", f"{stage}: micro batches per rank", None, text, (key,)),
        ]
    formula = ratio(rows, "sequences", micro, f"({key.rsplit('.', 2)[-2]}.{key.rsplit('.', 1)[-1]})")
    count = b.exact(rows, micro)
    return [
        rows_step,
        Step(f"{name}_micro_batches", f"{stage}: micro batches per rank", count, formula, (key,)),
    ]


def header(view: ConfigView, p: BatchPlan) -> str:
    """One line naming the trainer, mode and engine."""
    trainer = f"V1 trainer, {p.trainer_mode} mode" if p.v1 else "legacy trainer"
    return f"batch arithmetic ({trainer}, {p.actor.engine} actor{', critic' if p.use_critic else ''}{', reference model' if p.use_ref else ''})"


def render_text(view: ConfigView, steps: list[Step]) -> str:
    """The walk as text: ``label: value`` then the formula, then the keys."""
    lines = [header(view, b.batch_plan(view)), ""]
    width = max(len(step.label) for step in steps)
    for step in steps:
        value = "—" if step.value is None else str(step.value)
        lines.append(f"{step.label:<{width}} {value:>6}  = {step.formula}")
        if step.keys:
            lines.append(f"{'':<{width}}         keys: {', '.join(step.keys)}")
    return "\n".join(lines) + "\n"

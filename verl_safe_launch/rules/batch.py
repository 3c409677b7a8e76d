"""Batch arithmetic rules: verl's driver-side checks and its first-training-step checks, all up front."""

from __future__ import annotations

from collections.abc import Callable

from verl_safe_launch.config_view import ARR, ConfigView, ref_in_actor
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import verl_check, verl_release
from verl_safe_launch.rules.fixes import KeyFix, divisor_fix, set_fix
from verl_safe_launch.rules.kit import Draft, check, kv, late, not_positive, plan, skipped, stops
from verl_safe_launch.rules.plan import (
    ACTOR_DYNAMIC,
    ACTOR_MICRO,
    ACTOR_MINI,
    CRITIC_DYNAMIC,
    CRITIC_MINI,
    GPUS_PER_NODE,
    LOGPROB_MICRO,
    NNODES,
    REF_MICRO,
    ROLLOUT_N,
    TRAIN_BATCH,
    BatchPlan,
    RoleLayout,
    batch_plan,
    exact,
    pos_int,
    product,
    varying,
)

SIZES = (TRAIN_BATCH, ROLLOUT_N, GPUS_PER_NODE, NNODES)


def divides(whole: int | None, part: int | None) -> bool:
    """True when both are known and ``part`` divides ``whole``."""
    return whole is not None and part is not None and part != 0 and whole % part == 0


def sane(q: BatchPlan) -> bool:
    """The basic batch checks a suggested value must not break: S1, mini ≤ train batch, mini per rank."""
    fsdp_fixed = not q.dynamic and q.actor.engine != "megatron"
    whole_gpus = not fsdp_fixed or divides(q.trajectories, q.gpus)
    mini_fits = q.mini is None or q.prompts is None or q.dynamic or q.mini <= q.prompts
    mini_splits = q.actor.dp is None or divides(q.mini_trajectories, q.actor.dp)
    return whole_gpus and mini_fits and mini_splits


SEARCH_SPAN = 128


def solve(
    view: ConfigView, key: str, ok: Callable[[BatchPlan], bool], limit: int | None = None
) -> KeyFix | None:
    """The nearest values of ``key`` (within ±128, at most ``limit``) for which ``ok`` holds on the arithmetic.

    Values that also keep the basic batch checks passing are preferred when there are any.
    """
    current = pos_int(view.get(key))
    if current is None:
        return None
    at, top = varying(view, key), limit or current + SEARCH_SPAN
    found: dict[tuple[bool, bool], int] = {}
    for distance in range(1, SEARCH_SPAN + 1):
        for value in (current - distance, current + distance):
            side = value > current
            if not 1 <= value <= top or (True, side) in found:
                continue
            q = batch_plan(at(value))
            if ok(q):
                found.setdefault((sane(q), side), value)
        if (True, False) in found and (True, True) in found:
            break
    tier = [v for (good, _), v in found.items() if good] or list(found.values())
    ordered: list[int] = sorted(tier, key=lambda v: (abs(v - current), v))
    return KeyFix(key, tuple(ordered)) if ordered else None


def dp_text(layout: RoleLayout) -> str:
    """``8 data-parallel ranks (= 32 GPUs / Ulysses 4)``."""
    if layout.engine == "megatron":
        split = f"TP {layout.tp} × PP {layout.pp} × CP {layout.cp}"
        return f"{layout.dp} data-parallel ranks ({layout.gpus} GPUs / ({split}))"
    if layout.sp and layout.sp > 1:
        return f"{layout.dp} data-parallel ranks ({layout.gpus} GPUs / Ulysses {layout.sp})"
    return f"{layout.dp} data-parallel GPUs"


def split_keys(layout: RoleLayout) -> tuple[str, ...]:
    """The layout's keys, when it splits the GPUs at all (sp or tp·pp·cp above 1); else nothing to show."""
    return layout.keys if (layout.model_parallel or 1) > 1 else ()


def layout_reads(layout: RoleLayout) -> tuple[str, ...]:
    """Every key the layout's data-parallel size is computed from, also those left at 1 (cited, not shown)."""
    return (*layout.keys, GPUS_PER_NODE, NNODES)


PAD_READS = (
    TRAIN_BATCH,
    ROLLOUT_N,
    ACTOR_MINI,
    CRITIC_MINI,
    "trainer.use_v1",
    "critic.enable",
    "algorithm.adv_estimator",
)
"""What the V1 padding of a step's batch is computed from (a multiple of the data-parallel size and mini batches)."""


def unmodelled(layout: RoleLayout) -> list[Draft]:
    """A skip note for an engine whose data-parallel size the arithmetic does not model."""
    if layout.engine in ("fsdp", "megatron"):
        return []
    return [
        skipped(layout.keys, f"the {layout.role} engine '{layout.engine}' is not modelled (fsdp, megatron)")
    ]


@check(
    "batch-train-divisible-gpus",
    "train_batch_size × rollout.n divisible by the GPU count (verl, not Megatron)",
    needs=("code:train-batch-divisible",),
)
def train_divisible(ctx: RuleContext) -> list[Draft]:
    """validate_config: ``real_train_batch_size must be divisible by minimal possible batch size``."""
    view, p = ctx.view, plan(ctx)
    if (p.dynamic and not checked_when_dynamic("train-batch-divisible")) or view.get(
        f"{ARR}.actor.strategy"
    ) == "megatron":
        return []
    if skip := not_positive(view, SIZES):
        return skip
    if p.trajectories is None or p.gpus is None or divides(p.trajectories, p.gpus):
        return []
    msg = (
        f"{kv(view, TRAIN_BATCH)} × rollout.n {p.n} = {p.trajectories} sequences per step is not divisible by "
        f"the {p.gpus} GPUs (= n_gpus_per_node {p.gpus_per_node} × nnodes {p.nnodes}); {stops('train-batch-divisible')}"
    )

    def ok(q: BatchPlan) -> bool:
        return divides(q.trajectories, q.gpus)

    return [Draft(SIZES, msg, (solve(view, TRAIN_BATCH, ok), solve(view, ROLLOUT_N, ok)))]


def megatron_minimal(q: BatchPlan) -> int | None:
    """verl's Megatron minimal batch: (G / (tp·pp·cp)) × ppo_micro_batch_size_per_gpu."""
    return product(exact(q.gpus, product(q.actor.tp, q.actor.pp, q.actor.cp)), q.micro)


@check(
    "batch-megatron-train-divisible",
    "Megatron: train_batch_size × n divisible by dp × micro batch (verl)",
    needs=("code:megatron-minimal-batch",),
)
def megatron_train_divisible(ctx: RuleContext) -> list[Draft]:
    """validate_config's Megatron branch of the same check."""
    view, p = ctx.view, plan(ctx)
    if view.get(f"{ARR}.actor.strategy") != "megatron":
        return []
    if p.dynamic:
        if not checked_when_dynamic("megatron-minimal-batch"):
            return []
        if view.get(ACTOR_MICRO) is None:
            return [_no_micro_for_minimal(view)]
    minimal = megatron_minimal(p)
    if p.trajectories is None or minimal is None or divides(p.trajectories, minimal):
        return []
    msg = (
        f"{kv(view, TRAIN_BATCH)} × rollout.n {p.n} = {p.trajectories} sequences per step is not divisible by "
        f"{dp_text(p.actor)} × {ACTOR_MICRO.rsplit('.', 1)[1]} {p.micro} = {minimal}; {stops('megatron-minimal-batch')}"
    )

    def ok(q: BatchPlan) -> bool:
        return divides(q.trajectories, megatron_minimal(q))

    fixes = (solve(view, ACTOR_MICRO, ok, p.trajectories), solve(view, TRAIN_BATCH, ok))
    return [
        Draft(
            (TRAIN_BATCH, ROLLOUT_N, ACTOR_MICRO, *split_keys(p.actor)),
            msg,
            fixes,
            reads=layout_reads(p.actor),
        )
    ]


def checked_when_dynamic(check_name: str) -> bool:
    """True when the release makes the check also with ``use_dynamic_bsz=true`` (no ``if`` on it around it)."""
    site = verl_check(check_name)
    return site is not None and "use_dynamic_bsz" not in site.guards


def _no_micro_for_minimal(view: ConfigView) -> Draft:
    """Releases before 0.6 compute the Megatron minimal batch with the per-GPU micro batch even under dynamic
    batch size: unset, it is ``None`` and the multiplication raises."""
    msg = (
        f"{ACTOR_MICRO} is not set, and {verl_release().name} multiplies it into the Megatron minimal batch even "
        f"with {kv(view, ACTOR_DYNAMIC)}: a TypeError; {stops('megatron-minimal-batch')}"
    )
    return Draft((ACTOR_MICRO, ACTOR_DYNAMIC), msg, (set_fix(ACTOR_MICRO, 1),))


def _mini_exceeds(view: ConfigView, mini_key: str, role: str) -> list[Draft]:
    """Both keys fit (mini batch ≤ the step's batch), else the check of ``role``'s config that refuses it."""
    batch, mini = pos_int(view.get(TRAIN_BATCH)), pos_int(view.get(mini_key))
    if batch is None or mini is None or mini <= batch:
        return []
    msg = f"{kv(view, mini_key)} is larger than {kv(view, TRAIN_BATCH)}: the {role} mini batch cannot hold "
    msg += f"more prompts than one step; {stops(f'{role}-mini-le-train')}"
    return [Draft((mini_key, TRAIN_BATCH), msg, (set_fix(mini_key, batch), set_fix(TRAIN_BATCH, mini)))]


@check(
    "batch-mini-exceeds-train",
    "actor.ppo_mini_batch_size ≤ train_batch_size (verl)",
    needs=("code:actor-mini-le-train",),
)
def mini_exceeds(ctx: RuleContext) -> list[Draft]:
    """ActorConfig.validate: ``train_batch_size must be >= actor.ppo_mini_batch_size``."""
    return [] if plan(ctx).dynamic else _mini_exceeds(ctx.view, ACTOR_MINI, "actor")


@check(
    "batch-critic-mini-exceeds-train",
    "critic.ppo_mini_batch_size ≤ train_batch_size (verl)",
    needs=("code:critic-mini-le-train",),
)
def critic_mini_exceeds(ctx: RuleContext) -> list[Draft]:
    """CriticConfig.validate: ``train_batch_size must be >= critic.ppo_mini_batch_size``."""
    if not plan(ctx).use_critic or ctx.view.get(CRITIC_DYNAMIC) is True:
        return []
    return _mini_exceeds(ctx.view, CRITIC_MINI, "critic")


def _mini_split(view: ConfigView, mini_key: str, layout: RoleLayout, mini_t: int | None) -> list[Draft]:
    if skip := not_positive(view, (mini_key, ROLLOUT_N)) or unmodelled(layout):
        return skip
    dp = layout.dp
    if mini_t is None or dp is None or divides(mini_t, dp):
        return []
    n = view.get(ROLLOUT_N)
    msg = (
        f"{kv(view, mini_key)} × rollout.n {n} = {mini_t} trajectories per {layout.role} mini batch do not "
        f"split evenly over {dp_text(layout)}; {late()}"
    )
    role = layout.role

    def ok(q: BatchPlan) -> bool:
        return divides(q.critic_mini_trajectories if role == "critic" else q.mini_trajectories, dp)

    fixes = (solve(view, mini_key, ok, pos_int(view.get(TRAIN_BATCH))), solve(view, ROLLOUT_N, ok))
    return [Draft((mini_key, ROLLOUT_N, *split_keys(layout)), msg, fixes, reads=layout_reads(layout))]


@check(
    "batch-mini-per-gpu",
    "actor mini batch × n divisible by the actor's data-parallel size",
    needs=("code:mini-per-dp",),
)
def mini_per_gpu(ctx: RuleContext) -> list[Draft]:
    """TrainingWorker.train_mini_batch: ``Got mini_batch_size=... and get_data_parallel_size()=...``."""
    p = plan(ctx)
    return _mini_split(ctx.view, ACTOR_MINI, p.actor, p.mini_trajectories)


@check(
    "batch-critic-mini-per-gpu",
    "critic mini batch × n divisible by the critic's data-parallel size",
    needs=("code:mini-per-dp",),
)
def critic_mini_per_gpu(ctx: RuleContext) -> list[Draft]:
    """The same worker assertion for the critic, with the critic's own mini batch."""
    p = plan(ctx)
    return _mini_split(ctx.view, CRITIC_MINI, p.critic, p.critic_mini_trajectories) if p.use_critic else []


@check(
    "batch-micro-divides-mini",
    "actor micro batch per GPU divides the per-GPU mini batch",
    needs=("code:micro-divides-mini",),
)
def micro_divides_mini(ctx: RuleContext) -> list[Draft]:
    """prepare_micro_batches: ``data size must be divisible by ... micro_batch_size_per_gpu``."""
    view, p = ctx.view, plan(ctx)
    if p.dynamic:
        return []
    if skip := not_positive(view, (ACTOR_MICRO,)):
        return skip
    if p.mini_per_gpu is None or p.micro is None or divides(p.mini_per_gpu, p.micro):
        return []
    msg = (
        f"{kv(view, ACTOR_MICRO)} does not divide the per-GPU mini batch {p.mini_per_gpu} (= ppo_mini_batch_size "
        f"{p.mini} × rollout.n {p.n} / {dp_text(p.actor)}); {late()}"
    )

    def ok(q: BatchPlan) -> bool:
        return divides(q.mini_per_gpu, q.micro)

    fixes = (divisor_fix(ACTOR_MICRO, p.micro, p.mini_per_gpu), solve(view, ACTOR_MINI, ok, p.prompts))
    return [
        Draft(
            (ACTOR_MICRO, ACTOR_MINI, ROLLOUT_N, *split_keys(p.actor)),
            msg,
            fixes,
            reads=layout_reads(p.actor),
        )
    ]


def padded_text(p: BatchPlan) -> str:
    """How the scored batch came about: the V1 padding, or the plain step batch."""
    if not p.v1:
        return f"{p.padded} sequences"
    if not p.padding:
        return f"{p.padded} sequences"
    return f"{p.step_trajectories} sequences padded to {p.padded}, a multiple of {p.pad_multiple}"


def _logprob(
    view: ConfigView, p: BatchPlan, key: str, rows: int | None, layout: RoleLayout, stage: str
) -> list[Draft]:
    micro = pos_int(view.get(key))
    if skip := not_positive(view, (key,)):
        return skip
    if p.padded is not None and layout.dp and not divides(p.padded, layout.dp):
        msg = f"the {stage} batch ({padded_text(p)}) does not split over {dp_text(layout)}; {late()}"
        return [Draft((key, *split_keys(layout)), msg, reads=(*layout_reads(layout), *PAD_READS))]
    if rows is None or micro is None or divides(rows, micro):
        return []
    msg = (
        f"{kv(view, key)} does not divide the {rows} sequences each data-parallel rank scores in the {stage} pass "
        f"(= {padded_text(p)} / {dp_text(layout)}); {late()}"
    )
    field = "logprob" if key == LOGPROB_MICRO else "ref"

    def ok(q: BatchPlan) -> bool:
        return divides(getattr(q, f"{field}_rows"), getattr(q, f"{field}_micro"))

    fixes = (divisor_fix(key, micro, rows), solve(view, TRAIN_BATCH, ok))
    reads = (*layout_reads(layout), *layout_reads(p.actor), *PAD_READS)
    return [Draft((key, TRAIN_BATCH, ROLLOUT_N, *split_keys(layout)), msg, fixes, reads=reads)]


@check(
    "batch-logprob-micro",
    "old log-prob micro batch per GPU divides the (padded) batch per data-parallel rank",
    needs=("code:micro-divides-batch",),
)
def logprob_micro(ctx: RuleContext) -> list[Draft]:
    """compute_log_prob on the V1-padded batch (prepare_micro_batches, first training step)."""
    p = plan(ctx)
    if p.dynamic:
        return []
    return _logprob(ctx.view, p, LOGPROB_MICRO, p.logprob_rows, p.actor, "old log-prob")


@check(
    "batch-ref-logprob-micro",
    "reference log-prob micro batch per GPU divides the (padded) batch per rank",
    needs=("code:micro-divides-batch",),
)
def ref_logprob_micro(ctx: RuleContext) -> list[Draft]:
    """compute_ref_log_prob on the V1-padded batch (first training step)."""
    p = plan(ctx)
    if not p.use_ref or p.ref_dynamic or ref_in_actor(ctx.view):
        return []
    return _logprob(ctx.view, p, REF_MICRO, p.ref_rows, p.ref, "reference log-prob")


CRITIC_BUDGET_DEFAULT = 32768


def budgets(view: ConfigView, p: BatchPlan) -> list[tuple[str, RoleLayout, str]]:
    """(token budget key, role layout, pass) for every pass that runs with dynamic batch size."""
    out: list[tuple[str, RoleLayout, str]] = []
    if p.dynamic:
        out += [(f"{ARR}.actor.ppo_max_token_len_per_gpu", p.actor, "actor update")]
        out += [(f"{ARR}.rollout.log_prob_max_token_len_per_gpu", p.actor, "old log-prob")]
    if p.use_ref and p.ref_dynamic:
        out += [(f"{ARR}.ref.log_prob_max_token_len_per_gpu", p.ref, "reference log-prob")]
    if p.use_critic:
        names = (
            ("ppo_infer_max_token_len_per_gpu",)
            if p.v1
            else ("ppo_max_token_len_per_gpu", "ppo_infer_max_token_len_per_gpu")
        )
        out += [(f"critic.{name}", p.critic, "critic") for name in names]
    return out


def seq_split(layout: RoleLayout) -> int | None:
    """How many GPUs share one sequence: Ulysses (FSDP) or context parallel (Megatron)."""
    return layout.cp if layout.engine == "megatron" else layout.sp


@check("batch-token-budget", "dynamic batch size: token budget per GPU × sequence split ≥ prompt + response")
def token_budget(ctx: RuleContext) -> list[Draft]:
    """rearrange_micro_batches: ``max_token_len must be greater than the sequence length``."""
    view, p = ctx.view, plan(ctx)
    drafts: list[Draft] = []
    listed = budgets(view, p)
    keys = {key for key, _, _ in listed}
    for key, layout, stage in listed:
        prov = view.prov(key)
        if prov is None or prov.follows not in keys:
            drafts += _budget(view, p, key, layout, stage)
    return drafts


def _budget(view: ConfigView, p: BatchPlan, key: str, layout: RoleLayout, stage: str) -> list[Draft]:
    present = key in view
    value = view.get(key) if present else CRITIC_BUDGET_DEFAULT
    split, longest = seq_split(layout), p.max_seq_len
    if skip := not_positive(view, (key,)):
        return skip
    if split is None or longest is None or pos_int(value) is None or value * split >= longest:
        return []
    shown = kv(view, key) if present else f"{key}={value} (verl's default)"
    msg = (
        f"{shown} × sequence split {split} = {value * split} tokens is less than the longest sequence {longest} "
        f"(= max_prompt_length + max_response_length) in the {stage} pass; {late()}"
    )
    need = -(-longest // split)
    target = key if present else f"+{key}"
    return [
        Draft(
            (key, "data.max_prompt_length", "data.max_response_length"),
            msg,
            (KeyFix(target, (need, 2 * need)),),
        )
    ]


RULES: tuple[Rule[RuleContext], ...] = (
    train_divisible,
    megatron_train_divisible,
    mini_exceeds,
    critic_mini_exceeds,
    mini_per_gpu,
    critic_mini_per_gpu,
    micro_divides_mini,
    logprob_micro,
    ref_logprob_micro,
    token_budget,
)

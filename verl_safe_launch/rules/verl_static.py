"""verl's own static checks (``validate_config`` and its config dataclasses), all run at once, with fixes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from verl_safe_launch.audit import STRATEGY_KEYS
from verl_safe_launch.config_view import ARR, ConfigView, format_value, ref_in_actor
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import verl_check, verl_release
from verl_safe_launch.rules.fixes import KeyFix, divisor_fix, set_fix
from verl_safe_launch.rules.kit import Draft, check, is_true, kv, not_positive, plan, stops
from verl_safe_launch.rules.plan import (
    ACTOR_DYNAMIC,
    ACTOR_MICRO,
    ACTOR_MICRO_DEPRECATED,
    ACTOR_MINI,
    CRITIC_DYNAMIC,
    CRITIC_MICRO,
    CRITIC_MICRO_DEPRECATED,
    CRITIC_MINI,
    FSDP_STRATEGIES,
    GPUS_PER_NODE,
    LOGPROB_DYNAMIC,
    LOGPROB_MICRO,
    LOGPROB_MICRO_DEPRECATED,
    NNODES,
    REF_DYNAMIC,
    REF_MICRO,
    REF_MICRO_DEPRECATED,
    BatchPlan,
    pos_int,
)

SUGGESTED_MICRO = 4
LATE_MICRO = ("code:per-gpu-micro-asserted", "!code:deprecated-micro-converted")
"""A release whose workers assert the per-GPU micro batch and no longer derive it from the deprecated key."""


@dataclass(frozen=True)
class MicroKeys:
    """The deprecated/per-GPU micro batch pair of one stage, and what its per-GPU value must divide."""

    section: str
    deprecated: str
    per_gpu: str
    whole: Callable[[BatchPlan], int | None]
    dp: Callable[[BatchPlan], int | None]
    late: str
    check: str
    """The name of verl's check of the pair (``code:NAME``)."""


ACTOR_KEYS = MicroKeys(
    "actor", ACTOR_MICRO_DEPRECATED, ACTOR_MICRO, lambda p: p.mini_per_gpu, lambda p: p.actor.dp,
    "when the workers build the actor", "actor-micro-pair",
)  # fmt: skip
ROLLOUT_KEYS = MicroKeys(
    "actor_rollout_ref.rollout", LOGPROB_MICRO_DEPRECATED, LOGPROB_MICRO, lambda p: p.logprob_rows,
    lambda p: p.actor.dp, "when the workers build the actor", "rollout-micro-pair",
)  # fmt: skip
REF_KEYS = MicroKeys(
    "actor_rollout_ref.ref", REF_MICRO_DEPRECATED, REF_MICRO, lambda p: p.ref_rows, lambda p: p.ref.dp,
    "at the first reference log-prob pass", "ref-micro-pair",
)  # fmt: skip
CRITIC_KEYS = MicroKeys(
    "critic", CRITIC_MICRO_DEPRECATED, CRITIC_MICRO, lambda p: p.critic_mini_per_gpu, lambda p: p.critic.dp,
    "in the critic", "critic-micro-pair",
)  # fmt: skip


def per_gpu_fix(keys: MicroKeys, p: BatchPlan, start: int | None, extra: tuple[str, ...] = ()) -> KeyFix:
    """A per-GPU micro batch that divides what it must divide (largest ≤ ``start`` first)."""
    whole = keys.whole(p)
    reference = start or SUGGESTED_MICRO
    fix = divisor_fix(keys.per_gpu, reference, whole, extra) if whole else None
    return fix or set_fix(keys.per_gpu, reference, extra)


def micro_key_drafts(
    view: ConfigView, p: BatchPlan, keys: MicroKeys, dynamic_key: str, *, read_late: bool = True
) -> list[Draft]:
    """Both set, neither set, or only the deprecated one: each stops verl, early or late.

    ``read_late`` is False when no worker reads the keys after validate_config (the reference inside a LoRA actor).
    """
    dep, per = view.get(keys.deprecated), view.get(keys.per_gpu)
    pair = (keys.deprecated, keys.per_gpu)
    if dep is not None and per is not None:
        msg = f"{kv(view, keys.deprecated)} and {kv(view, keys.per_gpu)} are both set; {stops(keys.check)}"
        if keys.section == "critic" and getattr(view.prov(keys.per_gpu), "follows", None):
            msg += f" ({keys.per_gpu} follows {keys.deprecated} through verl's own interpolation)"
        return [Draft(pair, msg, (per_gpu_fix(keys, p, pos_int(per), (f"{keys.deprecated}=null",)),))]
    if dep is None and per is None:
        msg = f"{keys.per_gpu} is not set and {dynamic_key} is false; {stops(keys.check)}"
        return [
            Draft((keys.per_gpu, dynamic_key), msg, (per_gpu_fix(keys, p, None), set_fix(dynamic_key, True)))
        ]
    if per is None and read_late and all(verl_release().has(need) for need in LATE_MICRO):
        msg = (
            f"{kv(view, keys.deprecated)} is deprecated and {keys.per_gpu} is not set: {verl_release().name} accepts "
            f"this, then stops with a bare AssertionError {keys.late}"
        )
        start = max(1, dep // keys.dp(p)) if pos_int(dep) and keys.dp(p) else None
        return [Draft(pair, msg, (per_gpu_fix(keys, p, start, (f"{keys.deprecated}=null",)),))]
    return []


@check(
    "verl-actor-micro-keys",
    "actor micro batch: exactly the per-GPU key, unless dynamic batch size",
    needs=("code:actor-micro-pair",),
)
def actor_micro_keys(ctx: RuleContext) -> list[Draft]:
    """verl's ActorConfig check (both/neither), plus the deprecated key alone (fails in the workers)."""
    if is_true(ctx.view, ACTOR_DYNAMIC):
        return []
    return micro_key_drafts(ctx.view, plan(ctx), ACTOR_KEYS, ACTOR_DYNAMIC)


@check(
    "verl-rollout-logprob-micro-keys",
    "old log-prob micro batch: exactly the per-GPU key (fixed batch size)",
    needs=("code:rollout-micro-pair",),
)
def rollout_micro_keys(ctx: RuleContext) -> list[Draft]:
    """validate_config's rollout log-prob check, plus the deprecated key alone."""
    if is_true(ctx.view, ACTOR_DYNAMIC):
        return []
    return micro_key_drafts(ctx.view, plan(ctx), ROLLOUT_KEYS, ACTOR_DYNAMIC)


@check(
    "verl-ref-logprob-micro-keys",
    "reference log-prob micro batch: exactly the per-GPU key (fixed batch size)",
    needs=("code:ref-micro-pair",),
)
def ref_micro_keys(ctx: RuleContext) -> list[Draft]:
    """validate_config's ref check (when the reference model is used), plus the deprecated key alone."""
    p = plan(ctx)
    if not p.use_ref or (p.dynamic and p.ref_dynamic):
        return []
    dynamic_key = REF_DYNAMIC if p.dynamic else ACTOR_DYNAMIC
    return micro_key_drafts(ctx.view, p, REF_KEYS, dynamic_key, read_late=not ref_in_actor(ctx.view))


@check(
    "verl-critic-micro-keys",
    "critic micro batch: exactly the per-GPU key (fixed batch size)",
    needs=("code:critic-micro-pair",),
)
def critic_micro_keys(ctx: RuleContext) -> list[Draft]:
    """CriticConfig's check; the deprecated critic key alone always fails it (verl interpolates it)."""
    p = plan(ctx)
    if not p.use_critic or is_true(ctx.view, CRITIC_DYNAMIC):
        return []
    drafts = micro_key_drafts(ctx.view, p, CRITIC_KEYS, CRITIC_DYNAMIC)
    if drafts and _critic_by_default(ctx.view):
        hint = (
            "; did you mean `algorithm.adv_estimator=grpo`? verl's default estimator gae trains a critic, and no "
            "critic model is set (critic.model.path is verl's placeholder)"
        )
        grpo = set_fix("algorithm.adv_estimator", "grpo")
        if ctx.view.get(f"{ARR}.rollout.n") == 1:  # GRPO compares a group of responses per prompt
            grpo = set_fix(f"{ARR}.rollout.n", 5, extra=("algorithm.adv_estimator=grpo",))
        return [replace(d, message=d.message + hint, fixes=(grpo, *d.fixes)) for d in drafts]
    return drafts


def _critic_by_default(view: ConfigView) -> bool:
    """The critic runs only because verl's default estimator is gae: nobody set the estimator or a critic model."""
    layers = [getattr(getattr(view.prov(k), "source", None), "layer", None) for k in (ESTIMATOR, CRITIC_PATH)]
    return view.get(ESTIMATOR) == "gae" and all(str(layer) == "verl" for layer in layers)


ESTIMATOR, CRITIC_PATH = "algorithm.adv_estimator", "critic.model.path"


@check(
    "verl-dynamic-bsz-mismatch",
    "actor and old log-prob must agree on dynamic batch size",
    needs=("code:dynamic-bsz-equal",),
)
def dynamic_mismatch(ctx: RuleContext) -> list[Draft]:
    """The workers assert actor.use_dynamic_bsz == rollout.log_prob_use_dynamic_bsz."""
    view = ctx.view
    actor, logprob = view.get(ACTOR_DYNAMIC), view.get(LOGPROB_DYNAMIC)
    if bool(actor) == bool(logprob):
        return []
    msg = (
        f"{kv(view, ACTOR_DYNAMIC)} but {kv(view, LOGPROB_DYNAMIC)}: {verl_release().name} accepts this, then stops "
        "with a bare AssertionError when the workers build the actor"
    )
    return [Draft((ACTOR_DYNAMIC, LOGPROB_DYNAMIC), msg, (set_fix(LOGPROB_DYNAMIC, bool(actor)),))]


def _deprecated_micro(
    view: ConfigView, keys: MicroKeys, p: BatchPlan, mini_key: str, sp: tuple[str | None, int]
) -> list[Draft]:
    """The release's own checks of a deprecated global micro batch (``critic-...`` ones for the critic)."""
    prefix = "critic-" if keys.section == "critic" else ""
    m, mini, gpus = pos_int(view.get(keys.deprecated)), pos_int(view.get(mini_key)), p.gpus
    if m is None:
        return not_positive(view, (keys.deprecated,))
    replace = (per_gpu_fix(keys, p, None, (f"{keys.deprecated}=null",)),)
    drafts: list[Draft] = []
    if mini is not None and mini % m:
        msg = (
            f"{kv(view, mini_key)} is not divisible by the deprecated {kv(view, keys.deprecated)}; "
            f"{stops(prefix + 'deprecated-micro-divides')}"
        )
        drafts.append(Draft((mini_key, keys.deprecated), msg, replace))
    sp_key, sp_value = sp
    if gpus is not None and m * sp_value < gpus and verl_release().has(f"code:{prefix}deprecated-micro-sp"):
        used = (keys.deprecated, *(k for k in (sp_key, GPUS_PER_NODE, NNODES) if k))
        msg = (
            f"the deprecated {kv(view, keys.deprecated)} × ulysses_sequence_parallel_size {sp_value} is less "
            f"than the {gpus} GPUs; {stops(prefix + 'deprecated-micro-sp')}"
        )
        drafts.append(Draft(used, msg, replace))
    return drafts


@check(
    "verl-actor-deprecated-micro",
    "deprecated actor.ppo_micro_batch_size: divides the mini batch, × sp ≥ GPUs",
    needs=("code:deprecated-micro-divides",),
)
def actor_deprecated_micro(ctx: RuleContext) -> list[Draft]:
    """ActorConfig.validate on the deprecated global micro batch size."""
    view, p = ctx.view, plan(ctx)
    if is_true(view, ACTOR_DYNAMIC) or view.get(ACTOR_MICRO_DEPRECATED) is None:
        return []
    key = f"{ARR}.actor.ulysses_sequence_parallel_size" if p.actor.engine == "fsdp" else None
    sp = pos_int(view.get(key)) if key else 1
    return _deprecated_micro(view, ACTOR_KEYS, p, ACTOR_MINI, (key, sp or 1))


@check(
    "verl-critic-deprecated-micro",
    "deprecated critic.ppo_micro_batch_size: divides the mini batch, × sp ≥ GPUs",
    needs=("code:critic-deprecated-micro-divides",),
)
def critic_deprecated_micro(ctx: RuleContext) -> list[Draft]:
    """CriticConfig.__post_init__ / FSDPCriticConfig.validate on the deprecated global micro batch size."""
    view, p = ctx.view, plan(ctx)
    if not p.use_critic or is_true(view, CRITIC_DYNAMIC) or view.get(CRITIC_MICRO_DEPRECATED) is None:
        return []
    key = "critic.ulysses_sequence_parallel_size"
    sp: tuple[str | None, int] = (
        (key, pos_int(view.get(key)) or 1) if p.critic.engine == "fsdp" else (None, 0)
    )
    return _deprecated_micro(view, CRITIC_KEYS, p, CRITIC_MINI, sp)


LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@check("verl-loss-agg-mode", "actor.loss_agg_mode is one verl knows", needs=("code:loss-agg-mode",))
def loss_agg_mode(ctx: RuleContext) -> list[Draft]:
    """ActorConfig.__post_init__ (RayPPOTrainer._validate_config before 0.6): ``Invalid loss_agg_mode``."""
    key = f"{ARR}.actor.loss_agg_mode"
    modes = loss_agg_modes()
    if ctx.view.get(key) in modes:
        return []
    known = ", ".join(modes)
    msg = f"{kv(ctx.view, key)} is not a loss aggregation mode {verl_release().name} knows ({known}); "
    msg += stops("loss-agg-mode")
    return [Draft((key,), msg, (KeyFix(key, modes),))]


def loss_agg_modes() -> tuple[str, ...]:
    """The modes the release's own check lists (the strings it compares against), else 0.9.1's."""
    site = verl_check("loss-agg-mode")
    found = tuple(s for s in site.strings if s.replace("-", "").isalpha() and "-" in s) if site else ()
    return found or LOSS_AGG_MODES


@check(
    "verl-val-temperature",
    "sampling during validation needs rollout.temperature > 0",
    needs=("code:val-temperature",),
)
def val_temperature(ctx: RuleContext) -> list[Draft]:
    """validate_config: do_sample in val_kwargs with a non-positive rollout temperature."""
    view = ctx.view
    sample, temp = f"{ARR}.rollout.val_kwargs.do_sample", f"{ARR}.rollout.temperature"
    value = view.get(temp)
    if not view.get(sample) or not isinstance(value, int | float) or value > 0:
        return []
    msg = f"{kv(view, sample)} needs {temp} > 0, but it is {format_value(value)}; {stops('val-temperature')}"
    return [Draft((sample, temp), msg, (set_fix(temp, 1.0), set_fix(sample, False)))]


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@check("verl-lora-rank", "LoRA rank within what vLLM supports", needs=("code:vllm-lora-rank",))
def lora_rank(ctx: RuleContext) -> list[Draft]:
    """validate_config → get_vllm_max_lora_rank: rank above vLLM's largest."""
    view = ctx.view
    key = f"{ARR}.model.lora.rank"
    rank = view.get(key)
    if not (isinstance(rank, int) and rank > 0):
        key = f"{ARR}.model.lora_rank"
        rank = view.get(key)
    if view.get(f"{ARR}.model.lora.merge") or view.get(f"{ARR}.rollout.name") != "vllm":
        return []
    if not isinstance(rank, int) or rank <= VLLM_LORA_RANKS[-1]:
        return []
    msg = (
        f"{kv(view, key)} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; {stops('vllm-lora-rank')}"
    )
    return [Draft((key, f"{ARR}.rollout.name"), msg, (KeyFix(key, (VLLM_LORA_RANKS[-1], 256)),))]


ROUTER_MODES = ("disabled", "R2", "R3")


@check(
    "verl-router-replay",
    "router replay mode valid; R2 needs rollout_correction.bypass_mode=false",
    needs=("code:router-replay",),
)
def router_replay(ctx: RuleContext) -> list[Draft]:
    """EngineRouterReplayConfig and validate_config's router replay check."""
    view, p = ctx.view, plan(ctx)
    engine_key = "megatron" if p.actor.engine == "megatron" else "fsdp_config"
    key = f"{ARR}.actor.{engine_key}.router_replay.mode"
    mode, bypass = view.get(key), "algorithm.rollout_correction.bypass_mode"
    if mode is None:
        return []
    if mode not in ROUTER_MODES:
        msg = f"{kv(view, key)} is not a router replay mode ({', '.join(ROUTER_MODES)}); {stops('router-replay')}"
        return [Draft((key,), msg, (KeyFix(key, ROUTER_MODES),))]
    if mode == "R2" and view.get(bypass):
        msg = (
            f"{kv(view, key)} records routes while recomputing old log-probs, which {kv(view, bypass)} skips"
        )
        msg += f"; {stops('router-replay')}"
        return [Draft((key, bypass), msg, (set_fix(bypass, False), set_fix(key, "R3")))]
    return []


@check("verl-strategy", "each role's strategy matches model_engine (fsdp, fsdp2, fsdp_turbo | megatron)")
def strategy(ctx: RuleContext) -> list[Draft]:
    """FSDPEngineConfig's strategy check, and ``strategy=megatron`` without ``model_engine=megatron``."""
    view, p = ctx.view, plan(ctx)
    engine = view.get("model_engine")
    expected = {"dp": FSDP_STRATEGIES, "megatron": ("megatron",)}.get(str(engine))
    if expected is None:
        return []
    keys = [f"{ARR}.actor.strategy", f"{ARR}.ref.strategy"]
    if engine == "dp":
        keys += [f"{ARR}.actor.fsdp_config.strategy", f"{ARR}.ref.fsdp_config.strategy"]
    if p.use_critic:
        keys += ["critic.strategy"] + (["critic.fsdp.strategy"] if engine == "dp" else [])
    wrong = [key for key in keys if key in view and view.get(key) not in expected]  # a release may lack one
    shown = [key for key in wrong if getattr(view.prov(key), "follows", None) not in wrong]
    # Another engine's strategy is one root cause, reported once by the audit's engine-mismatch.
    other = {"dp": ("megatron",), "megatron": FSDP_STRATEGIES}[str(engine)]
    shown = [
        key for key in shown if not (key in STRATEGY_KEYS and view.explicit(key) and view.get(key) in other)
    ]
    return [_strategy_draft(view, key, str(engine), expected) for key in shown]


def _strategy_draft(view: ConfigView, key: str, engine: str, expected: tuple[str, ...]) -> Draft:
    msg = f"{kv(view, key)} does not fit model_engine={engine} (expects {', '.join(expected)}); "
    msg += f"{verl_release().name} stops here"
    fixes: list[KeyFix | None] = [KeyFix(key, expected)]
    if view.get(key) == "megatron":
        fixes.append(KeyFix("model_engine", ("megatron",)))
    return Draft((key, "model_engine"), msg, tuple(fixes))


MEGATRON_DTYPES = ("bfloat16", "float16")


@check(
    "verl-megatron-engine",
    "Megatron engine: dtype bfloat16/float16; dynamic CP needs max_seqlen_per_dp_cp_rank",
    needs=("code:megatron-dtype",),
)
def megatron_engine(ctx: RuleContext) -> list[Draft]:
    """McoreEngineConfig.__post_init__ for each Megatron role that runs."""
    p = plan(ctx)
    roles = [("actor", f"{ARR}.actor"), ("ref", f"{ARR}.ref"), ("critic", "critic")]
    used = {"actor": True, "ref": p.use_ref, "critic": p.use_critic}
    drafts: list[Draft] = []
    for role, prefix in roles:
        exists = bool(ctx.view.subtree(f"{prefix}.megatron"))
        if used[role] and getattr(p, role).engine == "megatron" and exists:
            drafts += _megatron_drafts(ctx.view, f"{prefix}.megatron", p.max_seq_len)
    return drafts


def _megatron_drafts(view: ConfigView, meg: str, seq_len: int | None) -> list[Draft]:
    drafts: list[Draft] = []
    dtype, dyn, cap = f"{meg}.dtype", f"{meg}.dynamic_context_parallel", f"{meg}.max_seqlen_per_dp_cp_rank"
    if view.get(dtype) not in MEGATRON_DTYPES:
        msg = f"{kv(view, dtype)} is not supported by Megatron (bfloat16, float16); {stops('megatron-dtype')}"
        drafts.append(Draft((dtype,), msg, (KeyFix(dtype, MEGATRON_DTYPES),)))
    if view.get(dyn) and pos_int(view.get(cap)) is None:
        msg = (
            f"{kv(view, dyn)} needs {cap} to be a positive integer, but it is {format_value(view.get(cap))}; "
        )
        msg += stops("megatron-dtype")
        drafts.append(Draft((dyn, cap), msg, (set_fix(cap, seq_len or 4096), set_fix(dyn, False))))
    return drafts


RULES: tuple[Rule[RuleContext], ...] = (
    actor_micro_keys,
    rollout_micro_keys,
    ref_micro_keys,
    critic_micro_keys,
    dynamic_mismatch,
    actor_deprecated_micro,
    critic_deprecated_micro,
    loss_agg_mode,
    val_temperature,
    lora_rank,
    router_replay,
    strategy,
    megatron_engine,
)

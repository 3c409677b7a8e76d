"""The batch arithmetic of one verl config (sizes per step, per role and per GPU) as frozen data."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from verl_safe_launch.config_view import ARR, ConfigView

GPUS_PER_NODE = "trainer.n_gpus_per_node"
NNODES = "trainer.nnodes"
TRAIN_BATCH = "data.train_batch_size"
ROLLOUT_N = f"{ARR}.rollout.n"
ACTOR_MINI = f"{ARR}.actor.ppo_mini_batch_size"
ACTOR_MICRO = f"{ARR}.actor.ppo_micro_batch_size_per_gpu"
ACTOR_MICRO_DEPRECATED = f"{ARR}.actor.ppo_micro_batch_size"
ACTOR_DYNAMIC = f"{ARR}.actor.use_dynamic_bsz"
PPO_EPOCHS = f"{ARR}.actor.ppo_epochs"
LOGPROB_MICRO = f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu"
LOGPROB_MICRO_DEPRECATED = f"{ARR}.rollout.log_prob_micro_batch_size"
LOGPROB_DYNAMIC = f"{ARR}.rollout.log_prob_use_dynamic_bsz"
REF_MICRO = f"{ARR}.ref.log_prob_micro_batch_size_per_gpu"
REF_MICRO_DEPRECATED = f"{ARR}.ref.log_prob_micro_batch_size"
REF_DYNAMIC = f"{ARR}.ref.log_prob_use_dynamic_bsz"
CRITIC_MINI = "critic.ppo_mini_batch_size"
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"
CRITIC_MICRO_DEPRECATED = "critic.ppo_micro_batch_size"
CRITIC_DYNAMIC = "critic.use_dynamic_bsz"
ROLLOUT_TP = f"{ARR}.rollout.tensor_model_parallel_size"
ROLLOUT_DP = f"{ARR}.rollout.data_parallel_size"
ROLLOUT_PP = f"{ARR}.rollout.pipeline_model_parallel_size"
MAX_PROMPT = "data.max_prompt_length"
MAX_RESPONSE = "data.max_response_length"
USE_V1 = "trainer.use_v1"
TRAINER_MODE = "trainer.v1.trainer_mode"
V1 = ("config:trainer.v1",)
"""What a rule about verl's V1 trainer needs: a release whose config has ``trainer.v1`` (0.9 and later)."""


def uses_v1(view: ConfigView) -> bool:
    """True when the launch runs verl's V1 trainer (``trainer.use_v1`` true; older releases have no such key)."""
    return view.get(USE_V1) is True


FSDP_STRATEGIES = ("fsdp", "fsdp2", "fsdp_turbo")
ROLE_PREFIX = {"actor": f"{ARR}.actor", "ref": f"{ARR}.ref", "critic": "critic"}


def pos_int(value: Any) -> int | None:
    """The value when it is a positive integer (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def exact(numerator: int | None, denominator: int | None) -> int | None:
    """``numerator / denominator`` when both are known and it divides evenly, else None."""
    if numerator is None or not denominator or numerator % denominator:
        return None
    return numerator // denominator


def product(*factors: int | None) -> int | None:
    """The product of known factors, None when any is unknown."""
    if any(f is None for f in factors):
        return None
    return math.prod(f for f in factors if f is not None)


def lcm(*values: int | None) -> int | None:
    """The least common multiple of known values, None when any is unknown."""
    if any(v is None for v in values):
        return None
    return math.lcm(*(v for v in values if v is not None))


@dataclass(frozen=True)
class RoleLayout:
    """How one training role (actor, ref, critic) splits the GPUs: engine, model parallel, data parallel."""

    role: str
    engine: str
    gpus: int | None
    keys: tuple[str, ...]
    sp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    vpp: int | None = None
    dynamic_cp: bool = False

    @property
    def model_parallel(self) -> int | None:
        """GPUs that share one data-parallel rank: sp (FSDP) or tp·pp·cp (Megatron)."""
        if self.engine == "fsdp":
            return self.sp
        if self.engine == "megatron":
            return product(self.tp, self.pp, self.cp)
        return None

    @property
    def dp(self) -> int | None:
        """Data-parallel size: G/sp (FSDP), G/(tp·pp·cp) (Megatron; 1 with dynamic context parallel)."""
        if self.engine == "megatron" and self.dynamic_cp:
            return 1
        return exact(self.gpus, self.model_parallel)


@dataclass(frozen=True)
class BatchPlan:
    """Every derived batch size of one config; a field is None when its inputs are unknown or uneven."""

    gpus_per_node: int | None
    nnodes: int | None
    gpus: int | None
    prompts: int | None
    n: int | None
    trajectories: int | None
    v1: bool
    trainer_mode: str
    sync_steps: int | None
    step_prompts: int | None
    step_trajectories: int | None
    use_ref: bool
    use_critic: bool
    actor: RoleLayout
    ref: RoleLayout
    critic: RoleLayout
    dynamic: bool
    ref_dynamic: bool
    mini: int | None
    mini_trajectories: int | None
    mini_per_gpu: int | None
    micro: int | None
    grad_accum: int | None
    ppo_epochs: int | None
    mini_batches: int | None
    optimizer_steps: int | None
    critic_mini: int | None
    critic_mini_trajectories: int | None
    critic_mini_per_gpu: int | None
    pad_multiple: int | None
    padded: int | None
    padding: int | None
    logprob_micro: int | None
    logprob_rows: int | None
    logprob_micro_batches: int | None
    ref_micro: int | None
    ref_rows: int | None
    ref_micro_batches: int | None
    rollout_tp: int | None
    rollout_dp: int | None
    rollout_pp: int | None
    rollout_world: int | None
    rollout_gpus: int | None
    replicas: int | None
    prompts_per_replica: int | None
    sequences_per_replica: int | None
    max_seq_len: int | None


def engine_of(strategy: Any) -> str:
    """``fsdp`` for the FSDP family, ``megatron``, or the strategy as written."""
    if strategy in FSDP_STRATEGIES:
        return "fsdp"
    return str(strategy)


def sp_keys(role: str) -> tuple[str, ...]:
    """The Ulysses keys of a role, the one verl reads first first."""
    if role == "critic":
        return ("critic.fsdp.ulysses_sequence_parallel_size",)
    prefix = ROLE_PREFIX[role]
    return (
        f"{prefix}.ulysses_sequence_parallel_size",
        f"{prefix}.fsdp_config.ulysses_sequence_parallel_size",
    )


def effective_sp(view: ConfigView, role: str) -> int | None:
    """The Ulysses size the role's engine uses (actor/ref: the legacy key wins when > 1)."""
    keys = sp_keys(role)
    first = view.get(keys[0])
    if len(keys) == 2 and not (pos_int(first) and first > 1):
        return pos_int(view.get(keys[1]))
    return pos_int(first)


def role_layout(view: ConfigView, role: str, gpus: int | None) -> RoleLayout:
    """The parallel layout of one training role on the trainer's GPUs."""
    prefix = ROLE_PREFIX[role]
    engine = engine_of(view.get(f"{prefix}.strategy"))
    if engine == "fsdp":
        return RoleLayout(role, engine, gpus, sp_keys(role), sp=effective_sp(view, role))
    if engine != "megatron":
        return RoleLayout(role, engine, gpus, (f"{prefix}.strategy",))
    meg = f"{prefix}.megatron"
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    tp, pp, cp = (pos_int(view.get(f"{meg}.{name}")) for name in names)
    vpp = pos_int(view.get(f"{meg}.virtual_pipeline_model_parallel_size"))
    dynamic_cp = view.get(f"{meg}.dynamic_context_parallel") is True
    keys = tuple(f"{meg}.{name}" for name in names)
    return RoleLayout(role, engine, gpus, keys, tp=tp, pp=pp, cp=cp, vpp=vpp, dynamic_cp=dynamic_cp)


def use_reference(view: ConfigView) -> bool:
    """verl's ``need_reference_policy``: KL in the reward or a KL loss."""
    return view.get("algorithm.use_kl_in_reward") is True or view.get(f"{ARR}.actor.use_kl_loss") is True


def use_critic(view: ConfigView) -> bool:
    """verl's ``need_critic``: ``critic.enable``, or unset and the GAE estimator."""
    enable = view.get("critic.enable")
    if enable is not None:
        return bool(enable)
    return bool(view.get("algorithm.adv_estimator") == "gae")


def sync_steps(view: ConfigView) -> int | None:
    """Local updates per training step: the mode's ``parameter_sync_step`` (1 when the mode has none)."""
    mode = view.get(TRAINER_MODE)
    if f"trainer.v1.{mode}.parameter_sync_step" not in view:
        return 1
    return pos_int(view.get(f"trainer.v1.{mode}.parameter_sync_step"))


def batch_plan(view: ConfigView) -> BatchPlan:
    """The frozen batch arithmetic of a composed config (shared by rules, explain and the memory model)."""
    gpn, nodes = pos_int(view.get(GPUS_PER_NODE)), pos_int(view.get(NNODES))
    gpus = product(gpn, nodes)
    prompts, n = pos_int(view.get(TRAIN_BATCH)), pos_int(view.get(ROLLOUT_N))
    v1 = uses_v1(view)
    steps = sync_steps(view) if v1 else 1
    actor, ref, critic = (role_layout(view, role, gpus) for role in ("actor", "ref", "critic"))
    with_critic = use_critic(view)
    mini, critic_mini = pos_int(view.get(ACTOR_MINI)), pos_int(view.get(CRITIC_MINI))
    mini_t, critic_mini_t = product(mini, n), product(critic_mini, n)
    step_t = product(exact(prompts, steps), n)
    multiple = lcm(actor.dp, mini_t, critic_mini_t if with_critic else 1) if v1 else actor.dp
    padded = round_up(step_t, multiple) if v1 else step_t
    mini_per_gpu, micro = exact(mini_t, actor.dp), pos_int(view.get(ACTOR_MICRO))
    epochs, mini_batches = pos_int(view.get(PPO_EPOCHS)), exact(padded, mini_t)
    logprob_rows, ref_rows = exact(padded, actor.dp), exact(padded, ref.dp)
    logprob_micro, ref_micro = pos_int(view.get(LOGPROB_MICRO)), pos_int(view.get(REF_MICRO))
    return BatchPlan(
        gpus_per_node=gpn,
        nnodes=nodes,
        gpus=gpus,
        prompts=prompts,
        n=n,
        trajectories=product(prompts, n),
        v1=v1,
        trainer_mode=str(view.get(TRAINER_MODE)) if v1 else "v0",
        sync_steps=steps,
        step_prompts=exact(prompts, steps),
        step_trajectories=step_t,
        use_ref=use_reference(view),
        use_critic=with_critic,
        actor=actor,
        ref=ref,
        critic=critic,
        dynamic=view.get(ACTOR_DYNAMIC) is True,
        ref_dynamic=view.get(REF_DYNAMIC) is True,
        mini=mini,
        mini_trajectories=mini_t,
        mini_per_gpu=mini_per_gpu,
        micro=micro,
        grad_accum=exact(mini_per_gpu, micro),
        ppo_epochs=epochs,
        mini_batches=mini_batches,
        optimizer_steps=product(steps, epochs, mini_batches),
        critic_mini=critic_mini,
        critic_mini_trajectories=critic_mini_t,
        critic_mini_per_gpu=exact(critic_mini_t, critic.dp),
        pad_multiple=multiple,
        padded=padded,
        padding=None if padded is None or step_t is None else padded - step_t,
        logprob_micro=logprob_micro,
        logprob_rows=logprob_rows,
        logprob_micro_batches=exact(logprob_rows, logprob_micro),
        ref_micro=ref_micro,
        ref_rows=ref_rows,
        ref_micro_batches=exact(ref_rows, ref_micro),
        max_seq_len=total(pos_int(view.get(MAX_PROMPT)), pos_int(view.get(MAX_RESPONSE))),
        **_rollout(view, gpus, prompts, n),
    )


def round_up(value: int | None, multiple: int | None) -> int | None:
    """``value`` rounded up to a multiple of ``multiple`` (V1's padding with no-op samples)."""
    if value is None or not multiple:
        return None
    return -(-value // multiple) * multiple


def total(*values: int | None) -> int | None:
    """The sum of known values, None when any is unknown."""
    if any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)


def _rollout(view: ConfigView, gpus: int | None, prompts: int | None, n: int | None) -> dict[str, Any]:
    tp, dp, pp = (pos_int(view.get(key)) for key in (ROLLOUT_TP, ROLLOUT_DP, ROLLOUT_PP))
    world = product(tp, dp, pp)
    pool = rollout_pool(view, gpus)
    replicas = exact(pool, world)
    return {
        "rollout_tp": tp,
        "rollout_dp": dp,
        "rollout_pp": pp,
        "rollout_world": world,
        "rollout_gpus": pool,
        "replicas": replicas,
        "prompts_per_replica": exact(prompts, replicas),
        "sequences_per_replica": exact(product(prompts, n), replicas),
    }


def rollout_pool(view: ConfigView, gpus: int | None) -> int | None:
    """GPUs the rollout replicas run on: the trainer's (hybrid), or the standalone pool in separate_async."""
    if uses_v1(view) and view.get(TRAINER_MODE) == "separate_async":
        prefix = f"{ARR}.rollout"
        return product(pos_int(view.get(f"{prefix}.n_gpus_per_node")), pos_int(view.get(f"{prefix}.nnodes")))
    return gpus


class ChangedValues(Mapping[str, Any]):
    """A few replaced leaves over the config's values (two dict lookups per read, no copy)."""

    def __init__(self, changes: Mapping[str, Any], base: Mapping[str, Any]) -> None:
        self._changes, self._base = dict(changes), base

    def __getitem__(self, key: str) -> Any:
        return self._changes[key] if key in self._changes else self._base[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default``."""
        return self._changes[key] if key in self._changes else self._base.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._changes or key in self._base

    def __iter__(self) -> Iterator[str]:
        yield from self._base
        yield from (k for k in self._changes if k not in self._base)

    def __len__(self) -> int:
        return len(self._base) + sum(1 for k in self._changes if k not in self._base)


def with_values(view: ConfigView, changes: Mapping[str, Any]) -> ConfigView:
    """The view with some leaves replaced, and the leaves that interpolate them following along."""
    changed: dict[str, Any] = {}
    for key, value in changes.items():
        changed.update(dict.fromkeys([key, *followers(view, key)], value))
    changed.update(changes)
    return ConfigView(ChangedValues(changed, view.values), view.provenance)


def varying(view: ConfigView, key: str) -> Callable[[Any], ConfigView]:
    """A function giving the view with ``key`` set to a value (its followers following along)."""
    keys = [key, *followers(view, key)]

    def at(value: Any) -> ConfigView:
        return ConfigView(ChangedValues(dict.fromkeys(keys, value), view.values), view.provenance)

    return at


def followers(view: ConfigView, key: str) -> list[str]:
    """Leaves whose value is a plain interpolation of ``key`` (directly or through another follower)."""
    found: list[str] = []
    frontier = [key]
    while frontier:
        target = frontier.pop()
        for prov in view.provenance.values():
            if prov.follows == target and prov.key not in found and _plain(prov.interpolation):
                found.append(prov.key)
                frontier.append(prov.key)
    return found


def _plain(interpolation: str | None) -> bool:
    return bool(interpolation) and str(interpolation).startswith("${") and str(interpolation).endswith("}")

"""GPU count and Ulysses sequence parallelism of a launch, as the per-GPU conversions of an upgrade need them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_safe_launch.config_view import ARR
from verl_safe_launch.inputs import OverrideToken

GPUS_KEYS = ("trainer.n_gpus_per_node", "trainer.nnodes")
ACTOR_SP = (
    f"{ARR}.actor.ulysses_sequence_parallel_size",
    f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size",
)
REF_SP = (
    f"{ARR}.ref.ulysses_sequence_parallel_size",
    f"{ARR}.ref.fsdp_config.ulysses_sequence_parallel_size",
)
CRITIC_SP = (
    "critic.ulysses_sequence_parallel_size",
    "critic.fsdp.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.ulysses_sequence_parallel_size",
)


@dataclass(frozen=True)
class Read:
    """One number of the launch: its value (None: unknown) and where it came from, in words."""

    value: int | None
    how: str


@dataclass(frozen=True)
class Layout:
    """What the launch says about its GPUs and sequence parallelism (read once, used by every conversion)."""

    gpus: Read
    actor_sp: Read
    critic_sp: Read

    def data_parallel(self, key: str) -> tuple[int | None, str, str]:
        """The data-parallel size a global micro batch size of ``key`` was split over, as a label (``8 GPUs``,
        ``4 data-parallel ranks``) and where the numbers came from (or why it is unknown)."""
        sp = self.critic_sp if key.startswith("critic.") else self.actor_sp
        gpus = self.gpus.value
        if gpus is None:
            return None, "", self.gpus.how
        if sp.value is None:
            return None, "", sp.how
        if sp.value < 1 or gpus % sp.value:
            return None, "", f"{gpus} GPUs do not split into groups of Ulysses SP {sp.value} ({sp.how})"
        if sp.value == 1:
            return gpus, f"{gpus} GPUs", f"{gpus} GPUs: {self.gpus.how}"
        dp = gpus // sp.value
        how = f"{dp} ranks = {gpus} GPUs / Ulysses SP {sp.value}; {gpus} GPUs: {self.gpus.how}; SP: {sp.how}"
        return dp, f"{dp} data-parallel ranks", how


def plain_int(value: str | None) -> int | None:
    """An override's value as an integer, None when it is not a plain one."""
    if value is None:
        return None
    try:
        return int(value.strip().strip("'\""))
    except ValueError:
        return None


def _last(tokens: Sequence[OverrideToken], keys: Sequence[str]) -> tuple[str, str | None, int | None] | None:
    found = None
    for token in tokens:
        key, sep, value = token.text.lstrip("+~").partition("=")
        if key.strip() in keys:
            found = (key.strip(), value if sep else None, token.source.line)
    return found


def read_number(
    tokens: Sequence[OverrideToken], keys: Sequence[str], default: object, unreadable: Mapping[str, str]
) -> Read:
    """The value of the first of ``keys`` as the launch sets it (the last override of any spelling wins), else the
    release's default; unknown when a part of the launch that was not read could set it."""
    last = _last(tokens, keys)
    if last is not None:
        key, value, line = last
        number = plain_int(value)
        where = f"line {line}" if line is not None else "the launch"
        if number is None:
            return Read(None, f"{key}={value} ({where}) is not a plain integer")
        return Read(number, f"{key}={number} ({where})")
    why = next((unreadable[k] for k in keys if k in unreadable), None)
    if why is not None:
        return Read(None, f"{keys[0]} is not set where it can be read: {why}")
    if isinstance(default, int) and not isinstance(default, bool):
        return Read(default, f"{keys[0]}={default} (the release's default; the launch does not set it)")
    return Read(None, f"{keys[0]} has no plain default ({default!r})")


def read_layout(
    tokens: Sequence[OverrideToken],
    defaults: Mapping[str, object],
    unreadable: Mapping[str, str],
    gpus: int | None,
) -> Layout:
    """The launch's GPUs (``--gpus N`` where the launch does not say) and its actor's and critic's Ulysses SP."""
    per_node = read_number(tokens, GPUS_KEYS[:1], defaults.get(GPUS_KEYS[0]), unreadable)
    nodes = read_number(tokens, GPUS_KEYS[1:], defaults.get(GPUS_KEYS[1]), unreadable)
    if per_node.value is not None and nodes.value is not None:
        total = Read(per_node.value * nodes.value, f"{per_node.how} × {nodes.how}")
    elif gpus is not None:
        total = Read(gpus, f"--gpus {gpus}")
    else:
        unknown = per_node if per_node.value is None else nodes
        total = Read(None, f"the GPU count is unknown ({unknown.how}); pass --gpus N")
    actor = read_number(tokens, ACTOR_SP, defaults.get(ACTOR_SP[0], 1), unreadable)
    critic = read_number(tokens, CRITIC_SP, defaults.get(CRITIC_SP[0], 1), unreadable)
    return Layout(total, actor, critic)

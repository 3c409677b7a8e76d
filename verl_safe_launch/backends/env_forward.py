"""Which of this machine's environment variables a Ray job gets, and which secrets it gets only by name.

Ray keeps a job's ``runtime_env`` with the job: whoever can reach the cluster's dashboard or job API reads every
variable in it. So by default a job gets the variables that tune a run (``DEFAULT_PREFIXES``) but no secret
(``secret.is_secret_name``): a secret goes only where it is named, ``--env-forward default,WANDB_API_KEY``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_safe_launch.errors import UsageError
from verl_safe_launch.secret import is_secret_name

DEFAULT_PREFIXES = ("VLLM_", "NCCL_", "HF_", "TRANSFORMERS_", "PYTORCH_", "TORCH_", "WANDB_", "VERL_")
"""Variables a run reads on the cluster, forwarded by default when set here (secrets among them excepted)."""
DEFAULT, NONE = "default", "none"
_ENTRY = re.compile(r"[A-Za-z_*?\[][A-Za-z0-9_*?\[\]!-]*")
WHERE = "--env-forward"


@dataclass(frozen=True)
class Forwarding:
    """The job's variables (name → value), and by name: the secrets among them, and the secrets held back."""

    values: dict[str, str]
    secrets: tuple[str, ...]
    held: tuple[str, ...]

    def record(self) -> dict[str, list[str]]:
        """What ``job.json`` keeps: names only."""
        return {
            "env_forwarded": sorted(self.values),
            "secrets_forwarded": list(self.secrets),
            "secrets_not_forwarded": list(self.held),
        }


def env_forward_arg(text: str) -> tuple[str, ...]:
    """``--env-forward``: comma-separated names or globs, ``default`` (the default set), or ``none``."""
    entries = tuple(part.strip() for part in text.split(",") if part.strip())
    if not entries or (NONE in entries and len(entries) > 1):
        raise UsageError(
            f"--env-forward {text!r}: give names or globs separated by commas, 'default', or 'none' alone",
            where=WHERE,
            fix="--env-forward default,WANDB_API_KEY (or --env-forward none)",
        )
    for entry in entries:
        if entry not in (DEFAULT, NONE) and not _ENTRY.fullmatch(entry):
            raise UsageError(
                f"--env-forward: {entry!r} is not a variable name or a glob of names",
                where=WHERE,
                fix="e.g. --env-forward default,NCCL_*,WANDB_API_KEY",
            )
    return entries


def choose_forwarding(env: Mapping[str, str], spec: Sequence[str] | None) -> Forwarding:
    """The variables of ``env`` the job gets under ``spec`` (None: ``default``). Globs and the default set never
    pick a secret; a secret is forwarded only when named exactly, and a named variable must be set here."""
    entries = tuple(spec) if spec else (DEFAULT,)
    chosen: set[str] = set()
    held: set[str] = set()
    for entry in entries:
        if entry == NONE:
            continue
        if entry == DEFAULT or any(c in entry for c in "*?["):
            matched = _default(env) if entry == DEFAULT else fnmatch.filter(env, entry)
            chosen |= {name for name in matched if not is_secret_name(name)}
            held |= {name for name in matched if is_secret_name(name)}
        elif entry in env:
            chosen.add(entry)
        else:
            raise UsageError(
                f"--env-forward names {entry}, which is not set here",
                where=WHERE,
                fix=f"export {entry}=... before submitting, or leave it out of --env-forward",
            )
    secrets = tuple(sorted(name for name in chosen if is_secret_name(name)))
    return Forwarding({name: env[name] for name in sorted(chosen)}, secrets, tuple(sorted(held - chosen)))


def _default(env: Mapping[str, str]) -> list[str]:
    return [name for name in env if name.startswith(DEFAULT_PREFIXES)]


def describe(forwarding: Forwarding) -> list[str]:
    """What the job gets, by name: the lines ``submit`` prints."""
    plain = [name for name in forwarding.values if name not in forwarding.secrets]
    lines = [f"environment for the job: {', '.join(plain) if plain else 'no variables'} (--env-forward)"]
    if forwarding.secrets:
        lines.append(
            f"secrets forwarded by name: {', '.join(forwarding.secrets)} (Ray shows a job's environment to "
            "whoever can reach the cluster's dashboard)"
        )
    if forwarding.held:
        held = ",".join(forwarding.held)
        lines.append(
            f"secrets not forwarded: {', '.join(forwarding.held)} (set them on the cluster, or forward them by "
            f"name: --env-forward default,{held})"
        )
    return lines


__all__ = ["DEFAULT_PREFIXES", "Forwarding", "choose_forwarding", "describe", "env_forward_arg"]

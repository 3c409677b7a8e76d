"""One command-line override applied to the composed config as Hydra applies it, and Hydra's refusals worded for
the user (an unknown key with a did-you-mean, a '+' on a key that exists)."""

from __future__ import annotations

from typing import Any

from verl_safe_launch.compose import _hydra
from verl_safe_launch.config_view import flatten
from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import OverrideToken, did_you_mean


def deepest_node(cfg: Any, key: str) -> str:
    """The longest prefix of ``key`` that names a node of ``cfg`` (walked without resolving anything)."""
    from omegaconf import DictConfig

    node, found = cfg, []
    for part in key.split("."):
        child = node._get_node(part) if isinstance(node, DictConfig) else None
        if child is None:
            break
        found.append(part)
        node = child
    return ".".join(found) or key


def try_apply(cfg: Any, override: Any, token: OverrideToken, *, lenient: bool) -> str | None:
    """Apply one override; when lenient, return Hydra's reason for a refused key instead of raising."""
    from hydra.errors import HydraException

    if _unknown_plain_key(cfg, override):
        # Hydra's own refusal, without its cost: OmegaConf copies the whole config to word the error it raises
        first = f"Could not override '{override.key_or_group}'."
        if lenient:
            return first
        error = refusal(first, override.key_or_group, token, cfg)
        assert error is not None
        raise error
    try:
        _hydra.apply_override(override, cfg)
    except HydraException as exc:
        first = str(exc).splitlines()[0]
        if lenient and first.startswith(("Could not override", "Could not append")):
            return first
        raise _override_error(exc, override, token, cfg) from None
    return None


def _unknown_plain_key(cfg: Any, override: Any) -> bool:
    """True when ``key=value`` names a key that a struct node of ``cfg`` lacks: Hydra refuses it ("Could not
    override")."""
    from omegaconf import DictConfig

    if override.is_add() or override.is_force_add() or override.is_delete() or override.package is not None:
        return False
    node = cfg
    for part in override.key_or_group.split("."):
        if not isinstance(node, DictConfig):
            return False
        child = node._get_node(part, validate_access=False)
        if child is None:
            return node._get_flag("struct") is True
        node = child
    return False


def _override_error(exc: Exception, override: Any, token: OverrideToken, cfg: Any) -> UsageError:
    first = str(exc).splitlines()[0]
    error = refusal(first, override.key_or_group, token, cfg)
    if error is not None:
        return error
    cause = exc.__cause__
    detail = f"{first} ({cause})" if cause else first
    return UsageError(f"cannot apply override '{token.text}': {detail}", token.source.describe())


def refusal(first: str, key: str, token: OverrideToken, cfg: Any) -> UsageError | None:
    """The user error for Hydra's refusal of a key (unknown key, '+' on an existing key), else None."""
    if first.startswith("Could not override"):
        hint = _did_you_mean(key, cfg)
        fix = f"did you mean '{hint}'?" if hint else f"if verl really reads it, add it with +{token.text}"
        return UsageError(f"unknown key '{key}': verl's config has no such key", token.source.describe(), fix)
    if first.startswith("Could not append"):
        return UsageError(
            f"'{key}' already exists, so '+' cannot add it",
            token.source.describe(),
            f"drop the '+': {token.text.lstrip('+')}",
        )
    return None


def _did_you_mean(key: str, cfg: Any) -> str | None:
    """A key of the config ``key`` means (a typo of a sibling, the same leaf moved), never one merely alike."""
    from omegaconf import OmegaConf

    if cfg is None:
        return None
    return did_you_mean(key, flatten(OmegaConf.to_container(cfg, resolve=False)))  # type: ignore[arg-type]

"""Advice an upgrade prints is applied and re-checked first: composition, the audit errors, verl's own
``validate_config``; a line that fails any of them is not shown as advice."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from verl_safe_launch.audit import Change, audit
from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import cli_tokens
from verl_safe_launch.shell import ScriptLaunch


def verl_validation(cfg: Any) -> str | None:
    """verl's own driver-side validation, as ``main_ppo`` calls it; None when it accepts the config."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet_logging(), _offline():
        warnings.simplefilter("ignore")
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config
        from verl.utils.device import auto_set_device

        try:
            auto_set_device(cfg)
            use_ref, use_critic = need_reference_policy(cfg), need_critic(cfg)
            validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)
        except Exception as exc:  # verl raises ValueError, AssertionError, TypeError, Hydra's errors
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
    return None


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """verl logs its accelerator probe at import; that is no part of an upgrade report."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """verl reads the critic's model config in validate_config: from the local cache only, never the network (a
    model name that is not cached fails the same way with and without the advice)."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, "1"))
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _errors(composed: Composed) -> set[tuple[str, tuple[str, ...]]]:
    findings = audit(composed)
    return {(f.rule_id, f.keys) for f in findings if f.severity is Severity.ERROR}


def _judge(launch: ScriptLaunch, fixes: Sequence[str], base: tuple[Any, Any, Any]) -> str | None:
    """Why the launch with ``fixes`` appended fails where it did not before (None: it does not)."""
    tokens = cli_tokens(list(fixes))
    composed = compose(replace(launch, tokens=(*launch.tokens, *tokens)).request(lenient=True))
    rejected, errors, verdict = base
    if len(composed.rejected) > len(rejected):
        return f"composition refuses it ({composed.rejected[-1].reason})"
    new_errors = _errors(composed) - errors
    if new_errors:
        rule, keys = sorted(new_errors)[0]
        return f"the audit reports [{rule}] on {', '.join(keys)}"
    after = verl_validation(composed.cfg)
    if after is not None and after != verdict:
        return f"verl's validate_config rejects it ({after})"
    return None


def verify_advice(launch: ScriptLaunch, changes: Sequence[Change]) -> list[Change]:
    """The changes, each piece of advice kept only when the upgraded launch with it still composes, gains no
    audit error and passes verl's ``validate_config`` as well as it did without it (all advice is tried
    together first; a failing group is halved until the lines that fail are found)."""
    advice = [c for c in changes if c.fix]
    if not advice:
        return list(changes)
    composed = compose(launch.request(lenient=True))
    base = (composed.rejected, _errors(composed), verl_validation(composed.cfg))
    failed: dict[str, str] = {}
    _bisect(launch, [c.fix for c in advice if c.fix], base, failed)
    out: list[Change] = []
    for change in changes:
        why = failed.get(change.fix) if change.fix else None
        if why is None:
            out.append(change)
            continue
        detail = (
            f"{change.detail}; verl 0.9.1 cannot be told to keep the old behaviour: {change.fix} fails, {why}"
        )
        out.append(replace(change, detail=detail, fix=None))
    return out


def _bisect(
    launch: ScriptLaunch, fixes: list[str], base: tuple[Any, Any, Any], failed: dict[str, str]
) -> None:
    why = _judge(launch, fixes, base)
    if why is None:
        return
    if len(fixes) == 1:
        failed[fixes[0]] = why
        return
    half = len(fixes) // 2
    _bisect(launch, fixes[:half], base, failed)
    _bisect(launch, fixes[half:], base, failed)

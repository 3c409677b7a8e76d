"""Advice an upgrade prints is applied and judged first, each line alone against the upgraded launch: it must
compose, add no error of ``check``, be accepted by verl and by the engine verl hands it to, pass verl's own
``validate_config``, and change what the run does. A line that fails is shown without it, with the reason.

The launch's own problems are set aside so that every line is judged: the errors ``check`` already reports are
not counted against a line, and verl's ``validate_config`` reads the models through a local stand-in (verl loads
the critic's Hugging Face config there; a model that is not downloaded here would otherwise fail every line alike).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from verl_safe_launch.audit import (
    AUDIT_RULES,
    Change,
    audit,
    equivalent_values,
    runtime_refusal,
    unread_because,
)
from verl_safe_launch.compose import Composed, Overlay
from verl_safe_launch.context import Architecture, RuleContext
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import cli_tokens, load_architecture, parse_override
from verl_safe_launch.preflight.pipeline import hardware_from_tokens
from verl_safe_launch.rules import run_rules
from verl_safe_launch.shell import ScriptLaunch

MODEL_TARGET = "HFModelConfig"
JUDGING = tuple(r for r in AUDIT_RULES if r.rule_id != "unknown-key")
"""The audit rules a line is judged by: a key the line adds that verl lacks is refused by composition already,
and the launch's own unknown keys are the same with and without the line."""


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
    """verl reads model configs in validate_config: from local files only, never the network."""
    import os

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


def stand_in_model(folder: Path, arch: Architecture | None) -> Path:
    """A model directory holding only a config.json with the launch's model shape (a generic Qwen2 shape when it
    is not known here): what verl's validate_config reads of a model."""
    heads, kv = (arch.num_attention_heads, arch.num_key_value_heads) if arch else (32, 8)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": heads * 64,
        "intermediate_size": heads * 128,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": arch.max_position_embeddings if arch else 32768,
        "vocab_size": 1024,
        "tie_word_embeddings": True,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _models_to(cfg: Any, folder: Path) -> None:
    """Every Hugging Face model node of ``cfg`` pointed at ``folder`` (tokenizers not loaded)."""
    from omegaconf import DictConfig, open_dict

    def walk(node: Any) -> None:
        if not isinstance(node, DictConfig):
            return
        target = node.get("_target_") if "_target_" in node else None
        with open_dict(node):
            if isinstance(target, str) and target.endswith(MODEL_TARGET):
                node.path, node.hf_config_path, node.tokenizer_path = str(folder), None, None
                node.load_tokenizer = False
            for key in list(node.keys()):
                with contextlib.suppress(Exception):
                    walk(node._get_node(key))

    walk(cfg)


class AdviceJudge:
    """Judges advice lines for one upgraded launch: composition and ``check`` on an overlay of the launch,
    verl's validate_config on a copy of its config with the line set."""

    def __init__(self, launch: ScriptLaunch, composed: Composed, folder: Path) -> None:
        self.launch = launch
        self.composed = composed
        self.overlay = Overlay()
        self.view = view = composed.view
        self.rejected = len(composed.rejected)
        actor = load_architecture(str(view.get("actor_rollout_ref.model.path") or "") or None)
        critic = load_architecture(str(view.get("critic.model.path") or "") or None)
        self.context = RuleContext(view, actor, critic, hardware_from_tokens(composed))
        self.errors = self._errors(composed)
        cfg = pickle.loads(pickle.dumps(composed.cfg))
        _models_to(cfg, stand_in_model(folder, critic or actor))
        self.cfg = pickle.dumps(cfg)
        self.verdict = verl_validation(pickle.loads(self.cfg))

    def _errors(self, composed: Composed) -> set[tuple[str, tuple[str, ...]]]:
        context = replace(self.context, view=composed.view)
        findings = [*audit(composed, JUDGING), *run_rules(context)]
        return {(f.rule_id, f.keys) for f in findings if f.severity is Severity.ERROR}

    def why_not(self, fix: str) -> str | None:
        """Why ``fix`` is not advice (None: it is), judged by all but verl's validate_config (see ``validated``)."""
        token = cli_tokens([fix])[0]
        key = token.text.lstrip("+").partition("=")[0]
        composed = self.overlay.extend(self.composed, self.launch.request(lenient=True), [token])
        if len(composed.rejected) > self.rejected:
            return f"composition refuses it ({composed.rejected[-1].reason})"
        view = composed.view
        before, value = self.view.get(key), view.get(key)
        if equivalent_values(key, before, value, view):
            return f"verl 0.9.1 reads it as it reads {before!r}: nothing would change"
        unread = unread_because(key, view)
        if unread is not None:
            return f"the upgraded run does not read it ({unread})"
        refusal = runtime_refusal(key, value, view)
        if refusal is not None:
            return refusal
        new_errors = self._errors(composed) - self.errors
        if new_errors:
            rule, keys = sorted(new_errors)[0]
            return f"check reports [{rule}] on {', '.join(keys)}"
        return None

    def validated(self, fixes: Sequence[str]) -> dict[str, str]:
        """Fix → why verl's validate_config refuses it, for those it refuses: the fixes are given to it together,
        and a group it refuses is halved until each refused fix is found."""
        from omegaconf import OmegaConf, open_dict

        cfg = pickle.loads(self.cfg)
        with open_dict(cfg):
            for fix in fixes:
                override = parse_override(cli_tokens([fix])[0])
                OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False, force_add=True)
        verdict = verl_validation(cfg)
        if verdict is None or verdict == self.verdict:
            return {}
        if len(fixes) == 1:
            return {fixes[0]: f"verl's validate_config rejects it ({verdict})"}
        half = len(fixes) // 2
        return {**self.validated(fixes[:half]), **self.validated(fixes[half:])}


def verify_advice(launch: ScriptLaunch, composed: Composed, changes: Sequence[Change]) -> list[Change]:
    """The changes, each piece of advice kept only when :class:`AdviceJudge` finds nothing against it; a line
    whose advice would change nothing is dropped, one whose advice fails is kept with the reason."""
    if not any(c.fix for c in changes):
        return list(changes)
    out: list[Change] = []
    with tempfile.TemporaryDirectory(prefix="vsl-advice-") as folder:
        judge = AdviceJudge(launch, composed, Path(folder))
        verdicts = {c.fix: judge.why_not(c.fix) for c in changes if c.fix}
        verdicts.update(judge.validated([fix for fix, why in verdicts.items() if why is None]))
        for change in changes:
            why = verdicts.get(change.fix) if change.fix else None
            if why is None:
                out.append(change)
            elif why.startswith(("verl 0.9.1 reads it as", "the upgraded run does not read")):
                continue
            else:
                detail = f"{change.detail}; the old behaviour cannot be kept: {change.fix} fails: {why}"
                out.append(replace(change, detail=detail, fix=None))
    return out

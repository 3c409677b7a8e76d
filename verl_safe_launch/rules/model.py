"""Model rules: what verl's HFModelConfig asserts about a local model directory."""

from __future__ import annotations

import os
from pathlib import Path

from verl_safe_launch.config_view import ARR
from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule, Severity
from verl_safe_launch.inputs import local_architectures, missing_model_files
from verl_safe_launch.rules.kit import Draft, check


@check(
    "model-architectures",
    "a local model's config.json names exactly one architecture (HFModelConfig asserts it)",
)
def one_architecture(ctx: RuleContext) -> list[Draft]:
    """HFModelConfig.__post_init__: ``assert len(architectures) == 1``."""
    drafts: list[Draft] = []
    for key in (f"{ARR}.model.path", "critic.model.path"):
        if key == "critic.model.path" and not _critic_used(ctx):
            continue
        found = local_architectures(ctx.view.get(key))
        if found is None or len(found) == 1:
            continue
        message = (
            f"{key}: its config.json lists {len(found)} architectures ({found}); verl's HFModelConfig asserts "
            "exactly one (Expect only one architecture) when it loads the model"
        )
        drafts.append(Draft((key,), message, fix_text='set "architectures": ["<ModelClass>"] in config.json'))
    return drafts


@check(
    "model-files-missing",
    "a local model directory holds the tokenizer and the weights verl loads",
    Severity.WARNING,
)
def files_missing(ctx: RuleContext) -> list[Draft]:
    """verl's workers load the tokenizer and the weights after Ray and the resource pools are up; a directory
    without them fails there (``run`` refuses it before Ray starts)."""
    drafts: list[Draft] = []
    for key in (f"{ARR}.model.path", "critic.model.path"):
        if key == "critic.model.path" and not _critic_used(ctx):
            continue
        value = ctx.view.get(key)
        directory = Path(os.path.expanduser(value)) if isinstance(value, str) and value else None
        if directory is None or not directory.is_dir():
            continue
        missing = missing_model_files(directory)
        if missing:
            message = (
                f"{key}={value}: the directory has no {'; no '.join(missing)}; verl loads them when its workers "
                "start, after Ray and the models' resource pools are up"
            )
            fix = f"put the whole model there (e.g. hf download MODEL_ID --local-dir {value})"
            drafts.append(Draft((key,), message, fix_text=fix))
    return drafts


def _critic_used(ctx: RuleContext) -> bool:
    enable = ctx.view.get("critic.enable")
    return bool(enable) if enable is not None else ctx.view.get("algorithm.adv_estimator") == "gae"


RULES: tuple[Rule[RuleContext], ...] = (one_architecture, files_missing)

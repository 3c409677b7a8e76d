"""Keys the release's trainer reads before training: the composed config must have them (``ConfigAttributeError``)."""

from __future__ import annotations

from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import config_reads, verl_release
from verl_safe_launch.rules.kit import Draft, check


@check("verl-config-read", "keys the release's trainer reads on every launch exist in the composed config")
def config_read(ctx: RuleContext) -> list[Draft]:
    """``RayPPOTrainer.__init__``/``_validate_config``/``validate_config`` read ``config.a.b`` as attributes."""
    view, drafts = ctx.view, []
    reads = [read for read in config_reads() if read.key not in view]
    leaves = list(view.keys())
    below = {read.key for read in reads for key in leaves if key.startswith(read.key + ".")}
    for read in reads:
        if read.key in below:
            continue  # a node of the config (its leaves exist); which keys exist reads no value
        msg = (
            f"{verl_release().name} reads config.{read.key} in {read.function} ({read.file}:{read.line}) on "
            f"every launch, and this config has no {read.key}: a ConfigAttributeError before training"
        )
        fix = f"compose a config of this verl that defines {read.key}, or add it (+{read.key}=...)"
        drafts.append(Draft((read.key,), msg, fix_text=fix))
    return drafts


RULES: tuple[Rule[RuleContext], ...] = (config_read,)

"""A Hydra callback that runs verl-safe-launch's pre-flight inside verl's own entry point, before training.

Enable it on any ``python -m verl.trainer.main_ppo`` command line with
``+hydra.callbacks.vsl._target_=hydra_plugins.verl_safe_launch.callback.PreflightCallback``.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback

SUPPORTED_CONFIG = "ppo_trainer"
ENABLE_OVERRIDE = "+hydra.callbacks.vsl._target_=hydra_plugins.verl_safe_launch.callback.PreflightCallback"


class PreflightCallback(Callback):
    """Before each job: compose the same overrides with provenance, run the pre-flight, stop on errors."""

    def on_job_start(self, config: Any, *, task_function: Any, **kwargs: Any) -> None:
        """Run the pre-flight on the overrides Hydra recorded; exit with status 1 when it finds errors."""
        config_name = str(config.hydra.job.config_name)
        if config_name != SUPPORTED_CONFIG:
            sys.stderr.write(
                f"verl-safe-launch: pre-flight skipped: it composes verl's {SUPPORTED_CONFIG} config, "
                f"this job uses {config_name}\n"
            )
            return
        code, text = preflight_report([str(item) for item in config.hydra.overrides.task])
        sys.stderr.write(text)
        sys.stderr.flush()
        if code:
            raise SystemExit(code)


def preflight_report(overrides: list[str]) -> tuple[int, str]:
    """Exit status (0 go, 1 errors, 2 unusable overrides) and the report for Hydra's raw task overrides."""
    from verl_safe_launch.compose import compose
    from verl_safe_launch.errors import EXIT_PREFLIGHT, VslError
    from verl_safe_launch.inputs import ComposeRequest, OverrideToken
    from verl_safe_launch.preflight import run_preflight
    from verl_safe_launch.provenance import Layer, Source
    from verl_safe_launch.render import render_findings_text

    tokens = tuple(OverrideToken(tool_token(text), Source(Layer.CLI, raw=text)) for text in overrides)
    header = "verl-safe-launch pre-flight (inside verl's entry point; presets are not adapted here)\n"
    try:
        preflight = run_preflight(compose(ComposeRequest(overrides=tokens)))
    except VslError as exc:
        return exc.exit_code, header + exc.render() + "\n"
    code = 0 if preflight.ok else EXIT_PREFLIGHT
    return code, header + render_findings_text(preflight.findings)


def tool_token(text: str) -> str:
    """Hydra's spelling of a tool token (``+preset=medium``, ``+hardware.nodes=2``) as verl-safe-launch's."""
    stripped = text.lstrip("+")
    key = stripped.partition("=")[0]
    if key == "preset" or key.startswith("hardware."):
        return stripped
    return text

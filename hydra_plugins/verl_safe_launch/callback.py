"""A Hydra callback that runs verl-safe-launch's pre-flight inside verl's own entry point, before training.

Enable it on any ``python -m verl.trainer.main_ppo`` command line with
``+hydra.callbacks.vsl._target_=hydra_plugins.verl_safe_launch.callback.PreflightCallback``.
``--cfg job`` prints the config and exits before Hydra starts the job, so the callback does not run there.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any

from hydra.experimental.callback import Callback

SUPPORTED_CONFIG = "ppo_trainer"
ENABLE_OVERRIDE = "+hydra.callbacks.vsl._target_=hydra_plugins.verl_safe_launch.callback.PreflightCallback"
HEADER = "verl-safe-launch pre-flight (inside verl's entry point; presets are not adapted here)\n"


HARDWARE_FIELDS = ("nodes", "gpus_per_node", "gpu_memory_gb", "gpu_name", "cpus_per_node")


class PreflightCallback(Callback):
    """Before each job: run the pre-flight on the config Hydra hands to verl; stop on errors.

    The hardware is declared to the callback itself (``+hydra.callbacks.vsl.gpus_per_node=4``), so it stays
    out of the config verl receives.
    """

    def __init__(self, **hardware: Any) -> None:
        unknown = sorted(set(hardware) - set(HARDWARE_FIELDS))
        if unknown:
            _stop(
                2,
                f"{HEADER}error: unknown callback setting(s) {', '.join(unknown)}\n"
                f"  where: command line (+hydra.callbacks.vsl.{unknown[0]}=...)\n"
                f"  fix: use {', '.join(HARDWARE_FIELDS)}\n",
            )
        self.hardware = {key: value for key, value in hardware.items() if value is not None}

    def on_job_start(self, config: Any, *, task_function: Any, **kwargs: Any) -> None:
        """Check the task config (Hydra's, without its ``hydra`` node); end the process on anything but GO.

        Hydra turns an exception raised by a callback into a warning and runs the job anyway, so nothing may
        leave this method as an exception: bad input ends the process with exit 2, errors found with exit 1
        and the report, and a failure of the pre-flight itself with exit 4; verl never validates or starts Ray.
        """
        try:
            code, text = self._check(config)
        except Exception as exc:  # a bug of ours: the pre-flight did not run, so the job must not either
            what = f"{type(exc).__name__}: {exc}".splitlines()[0]
            code, text = (
                4,
                f"{HEADER}internal error: {what} (a bug in verl-safe-launch); the job was stopped\n",
            )
        if code:
            _stop(code, text)
        _write(text)

    def _check(self, config: Any) -> tuple[int, str]:
        config_name = str(config.hydra.job.config_name)
        if config_name != SUPPORTED_CONFIG:
            return 0, (
                f"verl-safe-launch: pre-flight skipped: it composes verl's {SUPPORTED_CONFIG} config, "
                f"this job uses {config_name}\n"
            )
        overrides = [str(item) for item in config.hydra.overrides.task]
        return preflight_report(overrides, task_values(config), self.hardware)


def _stop(code: int, text: str) -> None:
    """Print ``text`` and end the process with ``code`` (SystemExit passes through Hydra's callback wrapper)."""
    from verl_safe_launch.render import escape_lines

    _write(escape_lines(text.rstrip("\n")) + "\n")
    sys.stdout.flush()
    raise SystemExit(code)


def _write(text: str) -> None:
    """To stderr as every output of verl-safe-launch leaves: invisible characters escaped, no secret's value."""
    from verl_safe_launch.render import shown

    sys.stderr.write(shown(text))
    sys.stderr.flush()


def task_values(config: Any) -> dict[str, Any]:
    """The config verl's task function receives (Hydra drops the ``hydra`` node), as dotted leaves."""
    from omegaconf import OmegaConf

    from verl_safe_launch.compose import check_interpolation_budget
    from verl_safe_launch.config_view import flatten
    from verl_safe_launch.errors import ConfigError

    container = OmegaConf.to_container(config, resolve=False)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    raw = flatten({str(key): value for key, value in container.items()})
    try:
        check_interpolation_budget(raw, lambda key: None)
    except ConfigError:  # resolving would not end: our composition of the same overrides reports the limit
        return raw
    task = OmegaConf.create(container)
    try:
        plain = OmegaConf.to_container(task, resolve=True)
    except Exception:  # an interpolation only verl's resolvers know: check the unresolved values
        plain = container
    assert isinstance(plain, dict)
    return flatten({str(key): value for key, value in plain.items()})


def stray_tool_keys(values: Mapping[str, Any], overrides: list[str]) -> list[str]:
    """Errors for tool tokens that reached verl's config as keys (``preset`` when the group was not found,
    ``hardware.*``)."""
    errors = []
    for key in (k for k in values if k.startswith("hardware.")):
        name = key.partition(".")[2]
        token = next((o for o in overrides if o.lstrip("+").startswith(f"{key}=")), f"+{key}={values[key]}")
        errors.append(
            f"error [tool-token-in-config] {token} reached verl as a config key '{key}': the hardware is "
            "declared to the pre-flight callback, not to verl\n"
            f"  fix: +hydra.callbacks.vsl.{name}={values[key]} (instead of {token})\n"
        )
    if "preset" in values:
        token = next(
            (o for o in overrides if o.lstrip("+").startswith("preset=")), f"+preset={values['preset']}"
        )
        errors.append(
            f"error [preset-not-found] {token} reached verl as a literal key 'preset: {values['preset']}': Hydra "
            "did not find verl-safe-launch's preset config group, so verl runs its own defaults\n"
            "  fix: install verl-safe-launch into the Python that runs verl (bash .ci/setup-venv, or pip install "
            "-e . / pip install . in the repository), so its Hydra plugin is discovered from any directory\n"
        )
    return errors


def preflight_report(
    overrides: list[str], values: Mapping[str, Any] | None = None, hardware: Mapping[str, Any] | None = None
) -> tuple[int, str]:
    """Exit status (0 go, 1 errors, 2 unusable overrides) and the report for Hydra's task overrides.

    ``values`` is the config Hydra composed for verl (dotted leaves): it is what gets checked; our own
    composition of the same overrides only supplies each value's provenance.
    """
    from dataclasses import replace

    from verl_safe_launch.compose import compose
    from verl_safe_launch.config_view import ConfigView
    from verl_safe_launch.errors import EXIT_PREFLIGHT, VslError
    from verl_safe_launch.inputs import ComposeRequest, OverrideToken, detect_hardware
    from verl_safe_launch.preflight import run_preflight
    from verl_safe_launch.provenance import Layer, Source
    from verl_safe_launch.render import render_error, render_findings_text

    stray = stray_tool_keys(values or {}, overrides)
    if stray:
        return EXIT_PREFLIGHT, HEADER + "".join(stray)
    tokens = tuple(OverrideToken(tool_token(text), Source(Layer.CLI, raw=text)) for text in overrides)
    tokens += tuple(
        OverrideToken(f"hardware.{key}={value}", Source(Layer.CLI, raw=f"+hydra.callbacks.vsl.{key}={value}"))
        for key, value in (hardware or {}).items()
    )
    try:
        composed = compose(ComposeRequest(overrides=tokens))
        if values is not None:
            composed = replace(composed, view=ConfigView(dict(values), composed.view.provenance))
        profile = replace(detect_hardware(composed.tool), in_entry_point=True)
        preflight = run_preflight(composed, profile)
    except VslError as exc:
        return exc.exit_code, HEADER + callback_spelling(render_error(exc)) + "\n"
    code = 0 if preflight.ok else EXIT_PREFLIGHT
    return code, HEADER + render_findings_text(preflight.findings)


_HARDWARE_TOKEN = re.compile(r"(?<![\w.+])hardware\.(" + "|".join(HARDWARE_FIELDS) + r")\b")


def callback_spelling(text: str) -> str:
    """A message of verl-safe-launch's own verbs with each ``hardware.X`` as the callback's setting: inside
    verl's entry point the hardware is declared as ``+hydra.callbacks.vsl.X``."""
    return _HARDWARE_TOKEN.sub(r"+hydra.callbacks.vsl.\1", text)


def tool_token(text: str) -> str:
    """Hydra's spelling of a tool token (``+preset=medium``, ``+hardware.nodes=2``) as verl-safe-launch's."""
    stripped = text.lstrip("+")
    key = stripped.partition("=")[0]
    if key == "preset" or key.startswith("hardware."):
        return stripped
    return text

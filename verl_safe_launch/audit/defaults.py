"""Behaviour that changes with an upgrade: every key whose value, as the old run had it and as the upgraded run has
it, differs, and that the upgraded run reads; each with the override that keeps the old behaviour."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from verl_safe_launch.audit.fork import OldDefaults
from verl_safe_launch.audit.readings import equivalent_values, global_size, new_key_of, unread_because
from verl_safe_launch.audit.upgrade import REMOVED, Change, _newer, override_value, token_key
from verl_safe_launch.compose import compose, parse_value
from verl_safe_launch.config_view import ConfigView, format_value, nest
from verl_safe_launch.inputs import ComposeRequest, OverrideToken, parse_override

# Behaviour that changed with no key to compare in the older release: (key, release, old value, why).
NEW_DEFAULTS: tuple[tuple[str, str, object, str], ...] = (
    (
        "trainer.use_v1",
        "0.9",
        False,
        "verl 0.9 runs the V1 trainer by default; the launch ran the legacy trainer",
    ),
)


def old_run(old: OldDefaults, tokens: Sequence[OverrideToken]) -> dict[str, Any]:
    """The old run's config: the old defaults with the launch's overrides applied as Hydra applies them (a key
    the old config lacks is skipped unless appended with ``+``), every interpolation resolved where it can be."""
    from omegaconf import OmegaConf

    flat = {k: v for k, v in old.defaults.items() if not (isinstance(v, dict) and v)}
    for token in tokens:
        prefix, key, text = token_key(token.text)
        if prefix == "~" or text is None or (key not in flat and "+" not in prefix) or "/" in key:
            continue
        ok, value = parse_value(text)
        if ok:
            flat[key] = value
            continue
        with contextlib.suppress(Exception):  # a value Hydra refuses fails the old run too: not its config
            flat[key] = parse_override(token).value()
    cfg = OmegaConf.create(nest(flat.items()))
    out: dict[str, Any] = {}
    for key, raw in flat.items():
        out[key] = _resolved(cfg, key, raw)
    return out


def _resolved(cfg: Any, key: str, raw: Any) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not (isinstance(raw, str) and "${" in raw):
        return raw
    try:
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        return raw  # an environment variable or a resolver of the old run: not known here
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def behaviour_changes(
    old: Mapping[str, Any],
    view: ConfigView,
    source: str,
    covered: Collection[str],
    installed: Mapping[str, object],
) -> list[Change]:
    """Every key the upgraded run reads whose value differs from the old run's, and that no other line of the
    report already covers; each with the override that keeps the old value (verified before it is shown)."""
    olds = dict(old)
    olds.update({k: v for k, since, v, _ in NEW_DEFAULTS if _newer(since, source) and k not in olds})
    changes: list[Change] = []
    seen: set[str] = set()
    for key, was in olds.items():
        now_key = new_key_of(key, source, installed)
        if now_key in seen or key in covered or now_key in covered or now_key not in view:
            continue
        if _skipped(key, now_key, was, olds):
            continue
        now = view.get(now_key)
        if equivalent_values(now_key, was, now, view) or unread_because(now_key, view) is not None:
            continue
        seen.add(now_key)
        changes.append(_change(key, now_key, was, now, source))
    return changes


def _skipped(key: str, now_key: str, was: Any, olds: Mapping[str, Any]) -> bool:
    """Keys not compared: a node, an interpolation the old run's environment resolves, a moved key whose new name
    the old release had too, a global size (a per-GPU size is read instead; converting one the launch sets is a
    line of its own)."""
    if isinstance(was, dict) or (isinstance(was, str) and "${" in was) or key.endswith("._target_"):
        return True
    if global_size(key) or global_size(now_key):
        return True
    return now_key != key and (now_key in olds or now_key.endswith("_per_gpu") != key.endswith("_per_gpu"))


def _change(key: str, now_key: str, was: Any, now: Any, source: str) -> Change:
    why = next((w for k, _, _, w in NEW_DEFAULTS if k == key), "the run behaves differently")
    named = "" if now_key == key else f" (as {key})"
    gone = next((r for r in REMOVED if r.key == key and r.value == was and _newer(r.release, source)), None)
    if gone is not None:
        why = f"{format_value(was)} was removed in verl {gone.release}: {gone.why}"
    detail = f"{format_value(was)} in the verl {source} run{named}, {format_value(now)} now: {why}"
    fix = None if gone is not None else f"{now_key}={override_value(was)}"
    return Change("default", now_key, detail, None, now_key, fix)


def installed_defaults() -> dict[str, object]:
    """The installed verl's defaults, flattened (what an upgraded or fixed launch is composed against)."""
    view = compose(ComposeRequest()).view
    return {key: view.get(key) for key in view.keys()}  # noqa: SIM118 (a view, not a dict)

"""Real projects built on older verl (tests/data/upgrade_projects/): each launch script upgraded in its checkout
(beside or below the project's vendored verl) and judged by oracles that are not the upgrade's own reasoning:

- the old run: the script's overrides composed by Hydra's own ``compose`` API from the project's vendored trainer
  YAML, interpolations resolved by OmegaConf;
- the new run: the upgraded YAML plus the printed command, composed for the installed verl;
- every advice line applied alone to the new run and given to verl's own ``validate_config`` (model paths pointed
  at a tiny local model, so that a model that is not downloaded here sets nothing aside), to the names verl
  registers (imported from verl itself) and to the load formats of the engine verl passes the value to.

Shared by tests/test_upgrade_projects.py and bench/upgrade_projects.py. Each project's SOURCE.json cites the
repository and commit its files were copied from.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from verl_safe_launch.cli import main
from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens

# The judges below also read the tool's own tables of how verl 0.9.1 reads a value (values read alike, keys a
# run does not read, where an old key lives now); each entry of those is checked against verl's code by
# tests/test_upgrade_readings.py. They are imported where used, so that an older tool can still be run here.

PROJECTS = Path(__file__).parent / "data" / "upgrade_projects"
SERIES = ("0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9")
ARR = "actor_rollout_ref"
MODEL_KEYS = (f"{ARR}.model.path", "critic.model.path", "reward.reward_model.model_path")


@dataclass(frozen=True)
class CorpusScript:
    """One launch script of one project, with where it came from."""

    project: str
    path: Path
    source: dict[str, Any]

    @property
    def name(self) -> str:
        """``Project/path/in/repo.sh``."""
        return f"{self.project}/{self.path.relative_to(PROJECTS / self.project)}"

    @property
    def truth(self) -> str:
        """The release series of the project's verl: the upstream release closest to its vendored copy."""
        closest = self.source["upstream"]["closest_release"]
        return ".".join(closest.split(".")[:2])

    @property
    def package(self) -> Path:
        """The project's vendored ``verl`` package."""
        return PROJECTS / self.project / self.source["verl"]


def corpus_scripts() -> list[CorpusScript]:
    """Every script of every project, sorted."""
    out: list[CorpusScript] = []
    for source_file in sorted(PROJECTS.glob("*/SOURCE.json")):
        source = json.loads(source_file.read_text())
        for entry in source["scripts"]:
            out.append(CorpusScript(source_file.parent.name, source_file.parent / entry["path"], source))
    return out


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """The CLI in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@dataclass
class Judged:
    """What one script's upgrade said, and what the oracles found wrong with it."""

    script: CorpusScript
    exit_code: int = 0
    error: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    noop: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)
    unreported: list[str] = field(default_factory=list)
    old_composed: bool = True

    @property
    def right(self) -> int:
        """Advice lines neither rejected nor a no-op."""
        bad = {line.split(": ")[0] for line in (*self.rejected, *self.noop)}
        return sum(fix not in bad for fix in self.advice)


def upgrade(script: Path, out_dir: Path, *extra: str) -> tuple[int, dict[str, Any] | None, str, float]:
    """``upgrade SCRIPT --format json``: exit code, the JSON document, stderr, seconds."""
    start = time.perf_counter()
    code, out, err = run_cli(
        ["upgrade", str(script), "--format", "json", "-o", str(out_dir), "--force", *extra]
    )
    seconds = time.perf_counter() - start
    return code, (json.loads(out) if code == 0 else None), err, seconds


def lone_detection(script: CorpusScript, tmp: Path) -> tuple[bool, str | None]:
    """The script copied alone (no vendored verl beside or above it): (asked for --from, release detected)."""
    lone = tmp / "lone" / script.path.name
    lone.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(script.path, lone)
    code, data, err, _ = upgrade(lone, tmp / "lone-out")
    shutil.rmtree(tmp / "lone", ignore_errors=True)
    shutil.rmtree(tmp / "lone-out", ignore_errors=True)
    if code == 2 and "--from" in err:
        return True, None
    assert data is not None, err
    return False, data["source_release"]


def within_one(detected: str, truth: str) -> bool:
    """True when two release series are at most one minor version apart."""
    return abs(SERIES.index(detected) - SERIES.index(truth)) <= 1


# ------------------------------------------------------------------------------------------------- the old run
def script_overrides(script: Path) -> list[str]:
    """The overrides of the script's first launch, as the tool's shell reader reads them (the reader is judged
    against real bash by tests/test_shell_corpus.py; both runs here read the same overrides)."""
    from verl_safe_launch.shell import read_script

    return [t.text for t in read_script(script)[0].tokens]


def old_config(package: Path, overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The old run's config: the project's own trainer YAML composed by Hydra with the overrides (one Hydra
    refuses is left out and returned: the old run could not have had it), interpolations resolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    kept, refused = list(overrides), []
    config_dir = str((package / "trainer" / "config").resolve())
    while True:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=config_dir, version_base=None):
                cfg = hydra_compose("ppo_trainer", overrides=kept)
            break
        except (HydraException, OmegaConfBaseException) as exc:
            bad = next((o for o in kept if _named(o, str(exc))), None)
            if bad is None:
                raise
            kept.remove(bad)
            refused.append(bad)
        finally:
            GlobalHydra.instance().clear()
    return _flat_resolved(OmegaConf.to_container(cfg, resolve=False)), refused


def _named(override: str, message: str) -> bool:
    key = override.lstrip("+~").partition("=")[0]
    return f"'{key}'" in message or f"{key}=" in message or key in message.split()


def _flat_resolved(container: Any) -> dict[str, Any]:
    """Every leaf, resolved (one whose interpolation cannot be resolved here keeps its text)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.create(container)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            full = f"{prefix}{key}"
            raw = OmegaConf.to_container(node, resolve=False)[key]  # type: ignore[index]
            if isinstance(raw, dict) and raw:
                walk(node[key], full + ".")
                continue
            try:
                value = OmegaConf.select(cfg, full, throw_on_resolution_failure=True)
                out[full] = (
                    OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
                )
            except OmegaConfBaseException:
                out[full] = raw

    walk(cfg, "")
    return out


# ------------------------------------------------------------------------------------------------- the new run
def upgraded_config(data: dict[str, Any], extra: list[str] | None = None) -> Composed:
    """The upgraded launch as its printed command runs it, plus ``extra`` overrides."""
    words = shlex.split(data["command"])[1:]
    files = tuple(Path(words[i + 1]) for i, w in enumerate(words) if w == "-c")
    tokens = [w for i, w in enumerate(words) if w != "-c" and (i == 0 or words[i - 1] != "-c")]
    return compose(
        ComposeRequest(config_files=files, overrides=cli_tokens([*tokens, *(extra or [])]), lenient=True)
    )


def verl_verdict(cfg: Any, model: Path) -> str | None:
    """verl's own driver-side validation as ``main_ppo`` calls it, the model paths pointed at ``model``."""
    import copy

    from omegaconf import OmegaConf, open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        for key in MODEL_KEYS:
            if OmegaConf.select(cfg, key) is not None:
                OmegaConf.update(cfg, key, str(model))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            auto_set_device(cfg)
            use_ref, use_critic = need_reference_policy(cfg), need_critic(cfg)
            validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)
        except Exception as exc:  # verl raises ValueError, AssertionError, TypeError, Hydra's errors
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:240]
    return None


@cache
def verl_registered() -> dict[str, frozenset[str]]:
    """Names verl 0.9.1 registers, imported from verl itself (not read by the tool's own source reader)."""
    from verl.trainer.ppo import core_algos
    from verl.workers.reward_manager import registry as reward_registry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    rollouts = getattr(RolloutReplicaRegistry, "_registry", {})
    return {
        "algorithm.adv_estimator": frozenset(core_algos.ADV_ESTIMATOR_REGISTRY),
        "reward.reward_manager.name": frozenset(reward_registry.REWARD_MANAGER_REGISTRY),
        f"{ARR}.rollout.name": frozenset(rollouts),
    }


def _runtime_refusal(key: str, value: Any, view: Any) -> str | None:
    """Why verl, or the engine it passes the value to, refuses it at run time (None: nothing refuses it)."""
    from verl_safe_launch.inputs import engine_load_formats

    if key == f"{ARR}.rollout.load_format":
        engine = view.get(f"{ARR}.rollout.name")
        formats = engine_load_formats().get(str(engine))
        if formats is not None and value not in formats:
            return f"{engine} has no load format {value!r}"
    names = verl_registered().get(key)
    if names and isinstance(value, str) and value not in names:
        return f"verl registers no {value!r} for {key}"
    return None


def judge(script: CorpusScript, out_dir: Path, model: Path) -> Judged:
    """Upgrade one script in its checkout and judge every line of the report."""
    code, data, err, seconds = upgrade(script.path, out_dir)
    return judge_result(script, code, data, err, seconds, model)


def judge_result(
    script: CorpusScript, code: int, data: dict[str, Any] | None, err: str, seconds: float, model: Path
) -> Judged:
    """Judge what an upgrade of ``script`` printed (its YAML still where the JSON says)."""
    judged = Judged(script, code, err.strip()[-300:], seconds)
    if data is None:
        return judged
    judged.data = data
    new = upgraded_config(data)
    with _offline():
        base_verdict = verl_verdict(new.cfg, model)
        for change in data["changes"]:
            if change["fix"]:
                _judge_line(judged, change, new, base_verdict, model)
    _judge_changes(judged, new)
    return judged


def _judge_line(judged: Judged, change: dict[str, Any], new: Composed, base: str | None, model: Path) -> None:
    from verl_safe_launch.audit import equivalent_values, runs_read

    fix = change["fix"]
    judged.advice.append(fix)
    key, _, _ = fix.partition("=")
    after = upgraded_config(judged.data, [fix])
    if after.rejected:
        judged.rejected.append(f"{fix}: composition refuses it ({after.rejected[0].reason})")
        return
    value = after.view.get(key)
    refusal = _runtime_refusal(key, value, after.view)
    verdict = verl_verdict(after.cfg, model)
    if refusal is None and verdict is not None and verdict != base:
        refusal = f"verl's validate_config: {verdict}"
    if refusal is not None:
        judged.rejected.append(f"{fix}: {refusal}")
        return
    before = new.view.get(key)
    if (
        _same(before, value)
        or equivalent_values(key, before, value, after.view)
        or not runs_read(key, after.view)
    ):
        judged.noop.append(f"{fix}: verl reads {key} as it did without the line ({before!r})")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return bool(a == b)


def _judge_changes(judged: Judged, new: Composed) -> None:
    """Every value the old run had that the new run changes, and every override of the script, is in a line."""
    from verl_safe_launch.audit import equivalent_values, global_size, new_key_of, runs_read

    data = judged.data
    mentioned = {c["key"] for c in data["changes"]} | {c["new_key"] for c in data["changes"] if c["new_key"]}
    overrides = script_overrides(judged.script.path)
    source = data["source_release"]
    for text in overrides:
        key = text.lstrip("+~").partition("=")[0]
        if key in mentioned or new_key_of(key, source) in mentioned:
            continue
        if new_key_of(key, source) not in new.view.values or not runs_read(new_key_of(key, source), new.view):
            judged.unreported.append(text)
    try:
        old, _ = old_config(judged.script.package, overrides)
    except Exception:  # the old run does not compose: there is no old behaviour to compare
        judged.old_composed = False
        return
    for key, was in old.items():
        now_key = new_key_of(key, source)
        if key in mentioned or now_key in mentioned or now_key not in new.view.values:
            continue
        if global_size(key) or global_size(now_key):
            continue  # a global size and a per-GPU size are not comparable; converting one is a line of its own
        now = new.view.get(now_key)
        if isinstance(was, dict | list) or _same(was, now) or equivalent_values(now_key, was, now, new.view):
            continue
        if isinstance(was, str) and "${" in was:
            continue  # not resolvable outside the old run (an environment variable, a custom resolver)
        if runs_read(now_key, new.view):
            judged.unlisted.append(f"{key}: {was!r} -> {now_key}={now!r}")


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No network: a model name verl would fetch is never fetched (the paths point at a local model anyway)."""
    import os

    from huggingface_hub import constants

    before, env = constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
        if env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env

"""Before a local Ray starts: can this machine load the model verl is given (a directory, the cache, the hub)?"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from verl_safe_launch.errors import VslError
from verl_safe_launch.inputs import missing_model_files
from verl_safe_launch.launch.deadline import within
from verl_safe_launch.launch.plan import LaunchBlocked

MODEL_KEY = "actor_rollout_ref.model.path"
PROBE_SECONDS = 10.0
"""How long the hub probe waits (one metadata request) before the hub counts as unreachable."""
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def model_access_error(
    path: str, env: Mapping[str, str], run_dir: Path, trust_remote_code: bool = False
) -> VslError | None:
    """Why verl could not load ``path`` on this machine, or None when it can (or it cannot be told here).

    A directory must hold what verl's workers load from it: config.json, the tokenizer (loaded here with
    transformers' ``AutoTokenizer``, as verl loads it, unless the model's own code would have to run) and the
    weights. A Hugging Face id is found in the local cache (its config.json), else the hub is asked once, within
    ``PROBE_SECONDS``; with ``HF_HUB_OFFLINE=1`` the cache alone decides.
    """
    where = f"{MODEL_KEY}={path}; run directory {run_dir}"
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        return _directory_error(local, where, trust_remote_code)
    if path.startswith(("/", "~", ".")) or path.count("/") > 1:
        return LaunchBlocked(
            f"the model directory {path} does not exist on this machine",
            where=where,
            fix=f"{MODEL_KEY}=<a directory holding the model's config.json and weights>",
        )
    if _cached(path, env):
        return None
    fix = _fix(path)
    offline = next((name for name in OFFLINE_VARS if env.get(name, "").lower() in ("1", "true", "yes")), None)
    if offline:
        return LaunchBlocked(
            f"{path} is not in the local Hugging Face cache ({_cache_dir(env)}) and {offline}=1 keeps verl off "
            "the hub (decided by the cache alone)",
            where=where,
            fix=fix,
        )
    reason = _probe(path)
    if reason is None:
        return None
    return LaunchBlocked(
        f"{path} is not in the local Hugging Face cache ({_cache_dir(env)}) and the hub does not serve it to "
        f"this machine: {reason} (probe: one metadata request, {PROBE_SECONDS:g} s at most)",
        where=where,
        fix=fix,
    )


def _directory_error(directory: Path, where: str, trust_remote_code: bool) -> VslError | None:
    missing = missing_model_files(directory)
    fix = f"put the whole model in {directory} (e.g. hf download MODEL_ID --local-dir {directory})"
    if missing:
        return LaunchBlocked(
            f"the model directory {directory} has no {'; no '.join(missing)}: verl's workers load them after "
            "Ray starts",
            where=where,
            fix=fix,
        )
    if trust_remote_code:  # loading the tokenizer would run the model's own code: verl's to do, not ours
        return None
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError ... for a bad tokenizer
        return LaunchBlocked(
            f"the tokenizer in {directory} does not load: {describe_exception(exc)}", where=where, fix=fix
        )
    return None


def _fix(path: str) -> str:
    return (
        f"download it where the hub is reachable (hf download {path} --local-dir DIR), copy DIR here and pass "
        f"{MODEL_KEY}=DIR; or point HF_HOME at a cache that holds it"
    )


def _cache_dir(env: Mapping[str, str]) -> str:
    from huggingface_hub import constants

    return str(env.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def _cached(repo_id: str, env: Mapping[str, str]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=env.get("HF_HUB_CACHE") or None)
    except Exception:  # an id the hub library refuses (bad characters): not in the cache
        return False
    return isinstance(found, str)


def _probe(repo_id: str) -> str | None:
    """None when the hub answers with the model's metadata; else what went wrong, in one line."""
    from huggingface_hub import HfApi

    try:
        within(lambda: HfApi().model_info(repo_id, timeout=PROBE_SECONDS), PROBE_SECONDS + 2)
    except TimeoutError:
        return f"no answer within {PROBE_SECONDS:g} s"
    except Exception as exc:
        return describe_exception(exc)
    return None


def describe_exception(exc: BaseException) -> str:
    """``Type: first line``, following the cause chain; never an empty reason.

    A message that is empty, or whose first line ends in a colon (Hydra's ``Error in call to target 'X':``), is
    completed by the next line or by the exception that caused it.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    head = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if cause is not None and cause is not exc and (not text or text.endswith(":")):
        return f"{head.rstrip(':')} (caused by {describe_exception(cause)})"
    return head

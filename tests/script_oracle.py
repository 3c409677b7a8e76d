"""Ground truth for a launch script under one verl copy: what bash really runs, what that copy's Hydra composes,
and what that copy's own validation says.

    .venv/bin/python tests/script_oracle.py SCRIPT --verl COPY [--root ROOT] [--json]
    .venv/bin/python tests/script_oracle.py --batch jobs.json --out results.json [--jobs 2]
    .venv/bin/python tests/script_oracle.py --derive tests/data/release_examples --releases DIR

``--derive`` writes ``expected.json`` beside the examples of each case: a release tag (``DIR/<version>`` holds that
release's ``pip install --no-deps --target`` install: the ``releases`` fixture's directory), a project tree with its
vendored ``verl/``, or a snapshot whose copy is shipped in ``tests/data/verl_copies/<case>`` (``--only`` picks cases).

COPY is a directory holding a ``verl/`` package (a ``pip --target`` release dir, a project's ``vendored/`` dir, or a
main snapshot). ROOT is the directory the script is run from (a project's copied repo tree, or a release's copied
examples): ``$(pwd)/...`` paths in the script are mapped there, and the mains of forks/recipes are looked up there.

Steps per script:
1. trace: the script runs under real bash with python/python3/torchrun/uv/ray/srun replaced by recorders
   (``verl_safe_launch.shell.trace_script``: real bash; nothing of the tool's judging is used);
2. every recorded command that runs a Hydra main (``-m pkg.mod`` or ``path/x.py`` whose source has
   ``@hydra.main``) is a launch; its ``--config-path/--config-name/--config-dir`` and overrides are read the way
   Hydra's own argparse reads them; a relative config path is resolved against the main's own directory (Hydra's
   rule), a ``$(pwd)/..`` path against ROOT;
3. in a subprocess with ``PYTHONPATH=COPY:ROOT`` (the copy shadows the 0.9.1 installed in this venv),
   Hydra's compose API composes that config (the copy's own YAML); launches whose config has no
   ``actor_rollout_ref`` (SFT, generation, eval mains) are reported as ``not-ppo`` and not validated;
4. model paths are pointed at a tiny local model (verl reads a critic's HF config in validate_config), then the
   copy's own validation runs the way its main_ppo runs it:
   - copies with ``verl.utils.config.validate_config`` (0.6 on, and forks of that age): ``auto_set_device``
     (where present), ``validate_config(config, use_reference_policy=need_reference_policy(..),
     use_critic=need_critic(config))``, then ``OmegaConf.resolve``;
   - older copies: ``OmegaConf.resolve`` (main_task does it first), then the copy's own
     ``RayPPOTrainer.__init__`` with the role mapping its main_ppo builds (RefPolicy always before 0.4, else only
     with a KL term; RewardModel when reward_model.enable), tokenizer/pools None and ``_create_dataloader``
     stubbed: this runs the asserts before validation (hybrid engine, KL controller, estimator) and
     ``_validate_config`` where the copy has one (0.1 has none).
   Verdict None: the copy accepts the launch. The worker runs with WANDB_MODE=disabled (a fork's trainer that
   starts its logger in __init__ would otherwise fail for want of a wandb login: environment, not config).

Shims so old copies import here (Python 3.11, the packages of this venv): ``pkg_resources`` (gone with
setuptools>=80; verl 0.4.x imports it in ``verl/__init__``) is given a two-function stand-in; ``openai`` (not in
the venv; verl 0.4.x's rollout server imports AsyncOpenAI and ChatCompletion at import time, ZeroSearch's fork
imports OpenAI) is given a stand-in whose every name is an empty class; any other third-party top-level package a
fork imports at module load and this venv lacks (ZeroSearch: serpapi) gets the same stand-in, named in the result's
``stubbed``;
``transformers.AutoModelForVision2Seq`` (gone in transformers 5; 0.6.x/0.7.0 import it by name) is given
``AutoModelForImageTextToText``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
ENV = {"HOME": "/home/vsl", "USER": "vsl"}
MODEL_KEYS = (
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "distillation.teacher_models.teacher_model.model_path",
)
TRACE_WORK = re.compile(r"^(?:/[^\s]*)?/vsl-trace-[^/]+/work(?=/|$)")
HYDRA_FLAGS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--experimental-rerun",
}
HYDRA_FLAGS_BARE = {
    "--resolve",
    "--multirun",
    "-m",
    "--run",
    "-r",
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--shell-completion",
    "-sc",
}


# ----------------------------------------------------------------------------------------------------- parent side
def trace(script: Path, timeout: float = 60.0) -> dict[str, Any]:
    """The command lines bash really ran (recorders)."""
    from verl_safe_launch.shell import trace_script

    t = trace_script(script, ENV, timeout=timeout)
    return {
        "calls": [list(c) for c in t.calls],
        "returncode": t.returncode,
        "stderr": t.stderr[-400:],
        "containment": t.containment,
    }


def _hydra_main(source: Path) -> tuple[str | None, str | None] | None:
    """(config_path, config_name) of the ``@hydra.main`` in a file, or None when it has none."""
    try:
        tree = ast.parse(source.read_text(errors="replace"))
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            name = ast.unparse(dec.func)
            if name not in ("hydra.main", "main") or (name == "main" and "hydra" not in source.read_text()):
                continue
            args: dict[str, Any] = {}
            for i, a in enumerate(dec.args):
                args[("config_path", "config_name")[i] if i < 2 else f"_{i}"] = a
            for kw in dec.keywords:
                args[kw.arg] = kw.value
            out = []
            for key in ("config_path", "config_name"):
                v = args.get(key)
                out.append(
                    v.value if isinstance(v, ast.Constant) else (None if v is None else ast.unparse(v))
                )
            return out[0], out[1]
    return None


def _find_module(module: str, roots: list[Path]) -> Path | None:
    rel = Path(*module.split("."))
    for root in roots:
        for cand in (root / rel.with_suffix(".py"), root / rel / "__main__.py"):
            if cand.is_file():
                return cand
    return None


def _find_file(path: str, roots: list[Path]) -> Path | None:
    mapped = _map_path(path, roots)
    return mapped if mapped is not None and mapped.is_file() else None


def _map_path(path: str, roots: list[Path]) -> Path | None:
    """A path as the script wrote it, seen from the directory it is run from (ROOT), else the copy."""
    m = TRACE_WORK.match(path)
    if m:
        rel = path[m.end() :].lstrip("/")
        for root in roots:
            if (root / rel).exists():
                return root / rel
        return None
    p = Path(path)
    if p.is_absolute():
        if p.exists():
            return p
        parts = p.parts[1:]
        for k in range(len(parts)):
            for root in roots:
                cand = root.joinpath(*parts[k:])
                if cand.exists():
                    return cand
        return None
    for root in roots:
        if (root / p).exists():
            return root / p
    return None


def launches_of(calls: list[list[str]], roots: list[Path]) -> list[dict[str, Any]]:
    """Every recorded command that runs a Hydra main, as a compose job."""
    out = []
    for n, argv in enumerate(calls):
        main = None
        start = None
        for i, w in enumerate(argv[1:], 1):
            if w == "-m" and i + 1 < len(argv) and re.fullmatch(r"[A-Za-z_][\w.]*", argv[i + 1]):
                f = _find_module(argv[i + 1], roots)
                if f is not None and _hydra_main(f) is not None:
                    main, start, label = f, i + 2, argv[i + 1]
                    break
            elif w.startswith("-m") and len(w) > 2 and re.fullmatch(r"-m[A-Za-z_][\w.]*", w):
                f = _find_module(w[2:], roots)
                if f is not None and _hydra_main(f) is not None:
                    main, start, label = f, i + 1, w[2:]
                    break
            elif w.endswith(".py"):
                f = _find_file(w, roots)
                if f is not None and _hydra_main(f) is not None:
                    main, start, label = f, i + 1, w
                    break
        if main is None:
            continue
        out.append(_job(n, argv, start, main, label, roots))
    return out


def _job(n: int, argv: list[str], start: int, main: Path, label: str, roots: list[Path]) -> dict[str, Any]:
    config_path, config_name = _hydra_main(main)  # type: ignore[misc]
    words = argv[start:]
    overrides: list[str] = []
    flags: dict[str, str] = {}
    notes: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        key, eq, val = w.partition("=")
        if w.startswith("-") and key in HYDRA_FLAGS_WITH_VALUE:
            if not eq:
                val = words[i + 1] if i + 1 < len(words) else ""
                i += 1
            flags[key] = val
        elif w.startswith("-") and w in HYDRA_FLAGS_BARE:
            flags[w] = ""
        elif w.startswith("-") and "=" not in w:
            notes.append(f"unknown flag {w!r} (Hydra's argparse would refuse it)")
            flags.setdefault("_unknown", w)
        else:
            overrides.append(w)
        i += 1
    cli_path = flags.get("--config-path", flags.get("-cp"))
    cli_name = flags.get("--config-name", flags.get("-cn"))
    name = cli_name if cli_name is not None else config_name
    path = cli_path if cli_path is not None else config_path
    config_dir: str | None = None
    mapped_from = None
    if path is not None:
        if os.path.isabs(path) or TRACE_WORK.match(path):
            found = _map_path(path, roots)
            mapped_from = path
            config_dir = str(found) if found is not None else None
            if found is None:
                notes.append(f"config path {path!r} not found from ROOT or the copy")
        else:
            config_dir = str((main.parent / path).resolve())  # Hydra: relative to the main's own module
            if not Path(config_dir).is_dir():
                notes.append(f"config path {path!r} relative to {main.parent} does not exist")
    extra_dir = flags.get("--config-dir", flags.get("-cd"))
    search = []
    if extra_dir:
        found = _map_path(extra_dir, roots)
        if found is not None:
            search.append(str(found))
        else:
            notes.append(f"config dir {extra_dir!r} not found")
    return {
        "call": n,
        "main": label,
        "main_file": str(main),
        "config_dir": config_dir,
        "config_path_as_written": mapped_from or path,
        "config_name": name,
        "overrides": overrides,
        "search": search,
        "flags": flags,
        "notes": notes,
    }


def run_worker(copy: Path, root: Path | None, jobs: list[dict[str, Any]], timeout: float = 900) -> list[Any]:
    """Compose + validate the jobs in one subprocess that imports the copy."""
    path = [str(copy)] + ([str(root)] if root is not None else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(path),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
            "RAY_DEDUP_LOGS": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "WANDB_MODE": "disabled",
            "WANDB_SILENT": "true",
        }
    )
    with tempfile.TemporaryDirectory(prefix="oracle-") as tmp:
        # The directory the launch runs from: ROOT's entries, with the copy's verl/ (and recipe/ where ROOT has
        # none) beside them, so a config's ``hydra.searchpath: file://verl/trainer/config`` finds the copy's YAML.
        cwd = Path(tmp) / "repo"
        cwd.mkdir()
        if root is not None:
            for entry in root.iterdir():
                if entry.name != "verl":
                    (cwd / entry.name).symlink_to(entry)
        for name in ("verl", "recipe"):
            if (copy / name).exists() and not (cwd / name).exists():
                (cwd / name).symlink_to(copy / name)
        payload = json.dumps({"jobs": jobs, "copy": str(copy), "tmp": tmp})
        proc = subprocess.run(
            [PYTHON, __file__, "--worker"],
            input=payload,
            capture_output=True,
            text=True,
            env=env,
            cwd=str(cwd),
            timeout=timeout,
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ORACLE-RESULT "):
            return json.loads(line[len("ORACLE-RESULT ") :])
    err = (proc.stderr.strip().splitlines() or ["no output"])[-3:]
    return [{"error": "worker failed: " + " | ".join(err)} for _ in jobs]


def oracle(script: Path, copy: Path, root: Path | None = None) -> dict[str, Any]:
    """Everything the oracle says about one script under one copy."""
    roots = [r for r in (root, copy) if r is not None]
    try:
        t = trace(script)
    except Exception as exc:  # a script bash cannot finish is a finding, not a crash
        return {
            "script": str(script),
            "copy": str(copy),
            "trace_error": f"{type(exc).__name__}: {exc}",
            "launches": [],
        }
    jobs = launches_of(t["calls"], roots)
    results = run_worker(copy, root, jobs) if jobs else []
    for job, res in zip(jobs, results, strict=True):
        job.update(res)
    return {
        "script": str(script),
        "copy": str(copy),
        "root": str(root) if root else None,
        "bash_returncode": t["returncode"],
        "calls": len(t["calls"]),
        "launches": jobs,
    }


ENV_BLOCKED = ("vllm version None not supported", "No API key configured")
"""Verdicts that say what this machine lacks (no vLLM/SGLang installed, no wandb login), not what the config is."""


def summary(launch: dict[str, Any]) -> str:
    """One word for a launch: runs / compose-error / fails / not-ppo / env-blocked / harness-error."""
    if launch.get("error"):
        return "harness-error"
    if any(p in (launch.get("verdict") or "") for p in ENV_BLOCKED):
        return "env-blocked"
    if str(launch.get("verdict") or "").startswith("harness:"):
        return "harness-error"
    if launch.get("kind") == "not-ppo":
        return "not-ppo"
    if launch.get("compose_error"):
        return "compose-error"
    if launch.get("verdict"):
        return "fails"
    return "runs"


def batch(spec: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """Many scripts; traces run in the parent, one worker subprocess per (copy, root) group, ≤ ``workers`` at once."""
    traced: list[dict[str, Any]] = []
    for item in spec:
        item = {
            **item,
            "script": str(Path(item["script"]).resolve()),
            "copy": str(Path(item["copy"]).resolve()),
            "root": str(Path(item["root"]).resolve()) if item.get("root") else None,
        }
        roots = [Path(r) for r in (item.get("root"), item["copy"]) if r]
        rec: dict[str, Any] = {**item, "launches": []}
        try:
            t = trace(Path(item["script"]))
            rec.update(bash_returncode=t["returncode"], calls=len(t["calls"]))
            rec["launches"] = launches_of(t["calls"], roots)
            for launch in rec["launches"]:
                launch["probes"] = list(item.get("probes", ()))
        except Exception as exc:
            rec["trace_error"] = f"{type(exc).__name__}: {exc}"
        traced.append(rec)
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for si, rec in enumerate(traced):
        for li, _ in enumerate(rec["launches"]):
            groups.setdefault((rec["copy"], rec.get("root") or ""), []).append((si, li))

    def one(key: tuple[str, str]) -> None:
        refs = groups[key]
        jobs = [traced[si]["launches"][li] for si, li in refs]
        for at in range(0, len(jobs), 60):
            chunk = jobs[at : at + 60]
            results = run_worker(Path(key[0]), Path(key[1]) if key[1] else None, chunk)
            for job, res in zip(chunk, results, strict=True):
                job.update(res)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, 2))) as pool:
        list(pool.map(one, list(groups)))
    for rec in traced:
        for launch in rec["launches"]:
            launch["summary"] = summary(launch)
    return traced


# ----------------------------------------------------------------------------------------------------- worker side
STUBBED: set[str] = set()
"""Third-party top-level modules absent here that a fork imports at module load (serpapi, ...): stand-ins."""


class _StubFinder:
    """Serves a stand-in module (every name an empty class) for the packages in STUBBED and their submodules."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        import importlib.machinery

        if name.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        import types

        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__getattr__ = _stand_in  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: Any) -> None:
        return None


def _stand_in(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


def _shims() -> list[str]:
    import importlib.metadata
    import types

    used = []
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        mod = types.ModuleType("pkg_resources")

        class DistributionNotFound(Exception):
            pass

        def get_distribution(name: str) -> Any:
            try:
                return types.SimpleNamespace(version=importlib.metadata.version(name), project_name=name)
            except importlib.metadata.PackageNotFoundError as exc:
                raise DistributionNotFound(name) from exc

        from packaging.version import parse as parse_version

        mod.DistributionNotFound = DistributionNotFound  # type: ignore[attr-defined]
        mod.get_distribution = get_distribution  # type: ignore[attr-defined]
        mod.parse_version = parse_version  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = mod
        used.append("pkg_resources stand-in")
    try:
        import openai  # noqa: F401
    except ImportError:  # verl 0.4.x's async rollout server imports two names from it at import time
        for name in ("openai", "openai.types", "openai.types.chat", "openai.types.chat.chat_completion"):
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__getattr__ = _stand_in  # type: ignore[attr-defined]
        used.append("openai stand-in (every name an empty class)")
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
        used.append("transformers.AutoModelForVision2Seq=AutoModelForImageTextToText")
    return used


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:400]


def _compose(job: dict[str, Any]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    overrides = list(job["overrides"])
    if job["search"]:
        overrides.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in job["search"]) + "]")
    if job["config_dir"] is None:
        raise FileNotFoundError(f"primary config directory not found: {job['config_path_as_written']}")
    with initialize_config_dir(config_dir=job["config_dir"], version_base=None):
        return compose(config_name=job["config_name"], overrides=overrides)


def _role_mapping(cfg: Any, main_src: str, trainer: Any = None) -> dict[Any, Any]:
    from verl.trainer.ppo.ray_trainer import Role

    own = getattr(sys.modules.get(getattr(trainer, "__module__", ""), None), "Role", None)
    if own is not None:  # a recipe's trainer with its own Role enum (recipe.spin)
        Role = own

    mapping = {Role.ActorRollout: object, Role.Critic: object}
    conditional = re.search(
        r"if\s+config\.algorithm\.use_kl_in_reward\s+or\s+config\.actor_rollout_ref\.actor"
        r"\.use_kl_loss\s*:",
        main_src,
    )
    if not conditional or cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss:
        mapping[Role.RefPolicy] = object
    rm = cfg.get("reward_model")
    if rm is not None and rm.get("enable", False):
        mapping[Role.RewardModel] = object
    return mapping


def _trainer_class(main_src: str, job: dict[str, Any]) -> tuple[Any, str]:
    """The trainer class the main constructs (a recipe's or fork's own), else verl's RayPPOTrainer."""
    import importlib

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    names = re.findall(r"trainer\s*=\s*([A-Za-z_]\w*)\(", main_src)
    name = names[-1] if names else "RayPPOTrainer"
    for mod, body in re.findall(r"^\s*from\s+([.\w]+)\s+import\s+(\([^)]*\)|[^\n]+)", main_src, re.M):
        if re.search(rf"\b{name}\b", body):
            if mod.startswith("."):
                pkg = job["main"].rsplit(".", 1)[0] if not job["main"].endswith(".py") else ""
                dots = len(mod) - len(mod.lstrip("."))
                base = pkg.rsplit(".", dots - 1)[0] if dots > 1 else pkg
                mod = f"{base}.{mod.lstrip('.')}" if mod.lstrip(".") else base
            try:
                return getattr(importlib.import_module(mod), name), f"{mod}.{name}"
            except Exception as exc:
                return RayPPOTrainer, f"RayPPOTrainer ({name} not importable: {type(exc).__name__})"
    if name == "RayPPOTrainer":
        return RayPPOTrainer, "RayPPOTrainer"
    return RayPPOTrainer, f"RayPPOTrainer ({name} not found)"


def _validate(cfg: Any, main_src: str, job: dict[str, Any]) -> tuple[str, str | None]:
    """(method, verdict) with the copy's own code."""
    import inspect

    from omegaconf import OmegaConf

    try:
        from verl.utils.config import validate_config
    except ImportError:
        validate_config = None
    if validate_config is not None:
        from verl.trainer.ppo import utils as ppo_utils

        try:
            from verl.utils.device import auto_set_device
        except ImportError:
            auto_set_device = None
        try:
            if auto_set_device is not None:
                auto_set_device(cfg)
            need_ref = ppo_utils.need_reference_policy
            if "role_worker_mapping" in inspect.signature(need_ref).parameters:
                use_ref = need_ref(_role_mapping(cfg, main_src))
            else:
                use_ref = need_ref(cfg)
            validate_config(config=cfg, use_reference_policy=use_ref, use_critic=ppo_utils.need_critic(cfg))
        except Exception as exc:
            return "validate_config", _err(exc)
        try:
            OmegaConf.resolve(cfg)
        except Exception as exc:
            return "validate_config", "resolve: " + _err(exc)
        return "validate_config", None
    try:
        OmegaConf.to_container(cfg, resolve=True)
        OmegaConf.resolve(cfg)
    except Exception as exc:
        return "trainer_init", "resolve: " + _err(exc)
    RayPPOTrainer, trainer_note = _trainer_class(main_src, job)

    class Probe(RayPPOTrainer):  # type: ignore[misc,valid-type]
        def _create_dataloader(self, *a: Any, **k: Any) -> None:
            return None

    kwargs: dict[str, Any] = {}
    for name, p in inspect.signature(RayPPOTrainer.__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "config":
            kwargs[name] = cfg
        elif name == "role_worker_mapping":
            kwargs[name] = _role_mapping(cfg, main_src, RayPPOTrainer)
        elif p.default is inspect.Parameter.empty:
            kwargs[name] = None
    method = f"trainer_init({trainer_note})" + (
        "+_validate_config" if hasattr(RayPPOTrainer, "_validate_config") else ""
    )
    try:
        Probe(**kwargs)
    except Exception as exc:
        return method, _err(exc)
    return method, None


def _point_models(cfg: Any, model: str) -> None:
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        for key in MODEL_KEYS:
            node, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, node, throw_on_missing=False)
            if parent is not None and leaf in parent:
                OmegaConf.update(cfg, key, model, merge=False)


def _importable_from_copy(top: str, data: dict[str, Any]) -> bool:
    """A package of the copy or of ROOT (then its absence is the corpus's fault, not a third-party gap)."""
    return any(
        (Path(p) / top).exists() or (Path(p) / f"{top}.py").exists()
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p
    )


def worker() -> None:
    import contextlib
    import io
    import warnings

    warnings.simplefilter("ignore")
    data = json.loads(sys.stdin.read())
    shims = _shims()
    sys.meta_path.append(_StubFinder())
    sys.path.insert(0, str(HERE))
    from conftest import make_tiny_model  # the tests' tiny model (config.json + tokenizer, no weights)

    sys.path.pop(0)
    model = str(make_tiny_model(Path(data["tmp"]) / "tiny-model"))
    import verl

    where = str(Path(verl.__file__).parent)
    out = []
    for job in data["jobs"]:
        res: dict[str, Any] = {"verl_imported_from": where, "shims": shims}
        main_src = Path(job["main_file"]).read_text(errors="replace")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                cfg = _compose(job)
            except BaseException as exc:
                res["compose_error"] = _err(exc)
                try:  # is it a PPO launch at all? (its config without the overrides)
                    bare = _compose({**job, "overrides": []})
                    res["kind"] = "ppo" if "actor_rollout_ref" in bare else "not-ppo"
                except BaseException:
                    res["kind"] = "unknown"
                out.append(res)
                continue
            if "actor_rollout_ref" not in cfg:
                res["kind"] = "not-ppo"
                out.append(res)
                continue
            res["kind"] = "ppo"
            _point_models(cfg, model)
            for _ in range(6):
                try:
                    res["method"], res["verdict"] = _validate(cfg, main_src, job)
                    if res["verdict"] is None and job.get("probes"):
                        res["probes"] = {rule: probe(rule, cfg) for rule in job["probes"]}
                except ModuleNotFoundError as exc:
                    top = (exc.name or "").split(".")[0]
                    if (
                        not top
                        or top in STUBBED
                        or top in ("verl", "recipe")
                        or _importable_from_copy(top, data)
                    ):
                        res["method"], res["verdict"] = "harness", "harness: " + _err(exc)
                        break
                    STUBBED.add(top)  # a third-party package this machine lacks: stand in and judge again
                    res.setdefault("stubbed", []).append(top)
                    cfg = _compose(job)
                    _point_models(cfg, model)
                    continue
                except BaseException as exc:
                    res["method"], res["verdict"] = "harness", "harness: " + _err(exc)
                break
        out.append(res)
    print("ORACLE-RESULT " + json.dumps(out))


# ------------------------------------------------------------------------------------------------ worker-stage probes
# Checks a release makes only after its validation, in the workers or at the first training step, run with that
# release's own code on the numbers of the composed config. Each returns the release's error, or None when its code
# accepts the numbers, or "n/a: ..." when the release does not reach that code for this config.


def _world(cfg: Any) -> int:
    return int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)


def _legacy_fsdp(cfg: Any) -> Path | None:
    """The release's legacy ``fsdp_workers.py`` when its main_ppo builds the actor from it, else None."""
    import verl

    source = Path(verl.__file__).parent / "workers" / "fsdp_workers.py"
    main_src = (Path(verl.__file__).parent / "trainer" / "main_ppo.py").read_text()
    strategy = cfg.actor_rollout_ref.actor.strategy
    if not source.is_file() or strategy not in ("fsdp", "fsdp2"):
        return None
    if (
        "use_legacy_worker_impl" in main_src
        and cfg.trainer.get("use_legacy_worker_impl", "auto") == "disable"
    ):
        return None
    return source


def _probe_micro_divides_mini(cfg: Any) -> str | None:
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if actor.get("use_dynamic_bsz"):
        return "n/a: dynamic batch size (micro batches by tokens)"
    legacy = _legacy_fsdp(cfg)
    if legacy is not None:
        return _legacy_normalization(legacy, cfg)
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    if actor.strategy not in ("fsdp", "fsdp2"):
        return f"n/a: strategy {actor.strategy}"
    dp = _world(cfg) // int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    mini = int(actor.ppo_mini_batch_size) * int(rollout.n)
    if mini % dp:  # engine_workers.py asserts this first
        return f"AssertionError: mini batch {mini} not divisible by data parallel size {dp}"
    rows = mini // dp
    micro = int(actor.ppo_micro_batch_size_per_gpu)
    data = tu.get_tensordict(
        tensor_dict={"input_ids": torch.zeros(rows, 1, dtype=torch.long)},
        non_tensor_dict={"use_dynamic_bsz": False, "micro_batch_size_per_gpu": micro},
    )
    try:
        prepare_micro_batches(data)
    except AssertionError as exc:
        return f"AssertionError: {exc} (prepare_micro_batches: {rows} rows per GPU, micro batch {micro})"
    return None


def _legacy_normalization(source: Path, cfg: Any) -> str | None:
    """Run the statements of the legacy ``ActorRolloutRefWorker.__init__`` that normalize the actor's mini batch
    and assert the micro batch divides it, read from the release's own source, on the composed numbers."""
    import types

    from omegaconf import OmegaConf

    tree = ast.parse(source.read_text())
    worker = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ActorRolloutRefWorker")
    init = next(n for n in worker.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    target = "self.config.actor.ppo_mini_batch_size"
    picked: list[ast.stmt] = []
    for node in ast.walk(init):
        assigns = isinstance(node, ast.AugAssign) and ast.unparse(node.target) == target
        if assigns or (isinstance(node, ast.Assert) and ast.unparse(node.test).startswith(f"{target} % ")):
            picked.append(node)
    picked.sort(key=lambda n: n.lineno)
    if not any(isinstance(n, ast.Assert) for n in picked):
        return f"n/a: no micro batch assert in {source.name}"
    sp = int(cfg.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
    world = _world(cfg)
    config = OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True))
    mesh = types.SimpleNamespace(size=lambda: world)
    fake = types.SimpleNamespace(config=config, device_mesh=mesh, ulysses_sequence_parallel_size=sp)
    code = compile(ast.Module(body=picked, type_ignores=[]), str(source), "exec")
    try:
        exec(code, {"self": fake})
    except AssertionError as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        line = tb.tb_lineno if tb is not None else 0
        return f"AssertionError: {exc} ({source.parent.name}/{source.name}:{line})"
    return None


def _probe_ulysses_gpus(cfg: Any) -> str | None:
    """The legacy worker's Ulysses mesh, ``(world // sp, sp)``, built by torch under a fake process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    source = _legacy_fsdp(cfg)
    if source is None:
        return "n/a: the actor is not built by the legacy fsdp worker"
    text = source.read_text()
    shape = "mesh_shape=(dp, self.ulysses_sequence_parallel_size)"
    if shape not in text or "dp = world_size // self.ulysses_sequence_parallel_size" not in text:
        return f"n/a: {source.name} builds its Ulysses mesh another way"
    sp = int(cfg.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
    world = _world(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        init_device_mesh("cpu", mesh_shape=(world // sp, sp), mesh_dim_names=["dp", "sp"])
    except Exception as exc:
        return f"{_err(exc)} (Ulysses mesh ({world // sp}, {sp}) over {world} GPUs)"
    finally:
        dist.destroy_process_group()
    return None


def _probe_rollout_ep(cfg: Any) -> str | None:
    """The rollout section made into the release's RolloutConfig, as the rollout worker makes it."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    try:
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
    except Exception as exc:
        return _err(exc) + " (RolloutConfig.__post_init__)"
    return None


def _probe_agent_chunks(cfg: Any) -> str | None:
    """The legacy trainer's generation batch (train batch × n) split over the agent loop workers by DataProto.chunk,
    as AgentLoopManager.generate_sequences splits it."""
    import torch
    from verl import DataProto

    rollout = cfg.actor_rollout_ref.rollout
    rows = int(cfg.data.train_batch_size) * int(rollout.n)
    if str(cfg.algorithm.adv_estimator) == "remax":
        rows += int(cfg.data.train_batch_size)
    workers = int(rollout.agent.num_workers)
    try:
        DataProto.from_dict({"input_ids": torch.zeros(rows, 1)}).chunk(workers)
    except AssertionError as exc:
        return f"AssertionError: {exc} (DataProto.chunk of {rows} sequences over {workers} agent workers)"
    return None


def _probe_rollout_config(cfg: Any) -> str | None:
    """RolloutConfig's other checks (async mode, MoE tensor parallel on trtllm only, ...): the rollout section with
    its expert parallel size set to what the EP assert wants, so that assert does not hide the rest."""
    from omegaconf import OmegaConf, open_dict

    rollout = OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True))
    with open_dict(rollout):
        tp, dp = rollout.get("tensor_model_parallel_size", 1), rollout.get("data_parallel_size", 1)
        rollout.expert_parallel_size = int(tp or 1) * int(dp or 1)
    return _probe_rollout_ep(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}}))


PROBES = {
    "batch-micro-divides-mini": _probe_micro_divides_mini,
    "layout-ulysses-gpus": _probe_ulysses_gpus,
    "layout-rollout-ep": _probe_rollout_ep,
    "verl-rollout-config": _probe_rollout_config,
    "batch-v0-agent-chunks": _probe_agent_chunks,
}
"""Checks the release makes after its validation: the rules whose findings such a probe can confirm."""


def probe(rule: str, cfg: Any) -> str | None:
    if rule not in PROBES:
        return f"n/a: no probe for {rule}"
    try:
        return PROBES[rule](cfg)
    except Exception as exc:
        return f"n/a: probe failed: {_err(exc)}"


# ----------------------------------------------------------------------------------------------------- derivation
COPIES = HERE / "data" / "verl_copies"
"""Copies of verl that are not on PyPI (a main snapshot), one directory each holding its ``verl/``."""


def copy_for(tag_dir: Path, releases: Path | None) -> Path:
    """The directory holding the ``verl/`` a case's scripts are judged with: the project's own vendored copy when
    the case is a project tree (``verl/`` at its repository path), a shipped copy named like the case, else the
    release ``releases/<version>``."""
    if (tag_dir / "verl").is_dir():
        return tag_dir
    if (COPIES / tag_dir.name / "verl").is_dir():
        return COPIES / tag_dir.name
    if releases is None:
        raise SystemExit(f"{tag_dir.name} is judged under a pip release: --derive needs --releases DIR")
    return releases / tag_dir.name.removeprefix("v")


def release_jobs(
    examples: Path, releases: Path | None, only: list[str] | None = None
) -> list[dict[str, Any]]:
    """One batch item per shipped script: ``examples/<case>/**.sh`` under the case's verl (``copy_for``)."""
    items = []
    for tag_dir in sorted(p for p in examples.iterdir() if p.is_dir()):
        if only and tag_dir.name not in only:
            continue
        copy = copy_for(tag_dir, releases)
        for script in sorted(tag_dir.rglob("*.sh")):
            items.append(
                {
                    "tag": tag_dir.name,
                    "path": str(script.relative_to(tag_dir)),
                    "script": str(script),
                    "copy": str(copy),
                    "root": str(tag_dir),
                }
            )
    return items


def expected_entry(launch: dict[str, Any]) -> dict[str, Any]:
    """What expected.json keeps of one launch: its main, config, verdict and the release's reason."""
    reason = launch.get("compose_error") or launch.get("verdict") or launch.get("error")
    return {
        "main": launch["main"],
        "config_name": launch["config_name"],
        "summary": launch["summary"],
        "reason": reason,
    }


def derive(examples: Path, releases: Path | None, workers: int, only: list[str] | None = None) -> None:
    """Write ``<case>/expected.json``: the oracle's verdict on every launch of every shipped script."""
    results = batch(release_jobs(examples, releases, only), workers)
    by_tag: dict[str, dict[str, Any]] = {}
    copies: dict[str, str] = {}
    for rec in results:
        copies[rec["tag"]] = rec["copy"]
        entries = [expected_entry(launch) for launch in rec["launches"]]
        for entry in entries:  # no path of this machine in the data
            for where, name in ((rec["copy"], "<release>"), (rec["root"], "<examples>")):
                entry["reason"] = entry["reason"] and entry["reason"].replace(where, name)
        by_tag.setdefault(rec["tag"], {})[rec["path"]] = {
            "launches": entries,
            **({"trace_error": rec["trace_error"]} if "trace_error" in rec else {}),
        }
    for tag, scripts in by_tag.items():
        out = {
            "derived_by": "python tests/script_oracle.py --derive tests/data/release_examples "
            + ("--releases DIR" if releases and Path(copies[tag]).parent == releases else f"--only {tag}"),
            "release": (Path(copies[tag]) / "verl" / "version" / "version").read_text().strip(),
            "scripts": dict(sorted(scripts.items())),
        }
        (examples / tag / "expected.json").write_text(json.dumps(out, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("script", nargs="?")
    ap.add_argument("--verl", help="a directory holding the verl/ package to judge with")
    ap.add_argument("--root", help="the directory the script is run from (project tree / release examples)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--batch", help="JSON list of {script, copy, root, ...}")
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--derive", type=Path, help="write expected.json for every release tag under this directory"
    )
    ap.add_argument(
        "--releases", type=Path, help="with --derive: a directory holding <version>/verl per release"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        help="with --derive: only these cases (directory names under the --derive directory)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker()
        return 0
    if ns.derive:
        derive(ns.derive.resolve(), ns.releases.resolve() if ns.releases else None, ns.jobs, ns.only)
        return 0
    if ns.batch:
        res = batch(json.loads(Path(ns.batch).read_text()), ns.jobs)
        Path(ns.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if not ns.script or not ns.verl:
        ap.error("SCRIPT and --verl are required")
    res = oracle(
        Path(ns.script).resolve(), Path(ns.verl).resolve(), Path(ns.root).resolve() if ns.root else None
    )
    for launch in res["launches"]:
        launch["summary"] = summary(launch)
    if ns.json:
        print(json.dumps(res, indent=1))
    else:
        for launch in res["launches"]:
            print(
                f"call {launch['call']} {launch['main']} [{launch['config_name']}]: {launch['summary']}"
                f" {launch.get('compose_error') or launch.get('verdict') or launch.get('error') or ''}"
            )
        if not res["launches"]:
            print("no Hydra launch found", res.get("trace_error", ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

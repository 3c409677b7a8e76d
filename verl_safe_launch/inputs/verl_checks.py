"""What a verl release checks, read from its own source with ``ast``: the asserts and raises it runs, per release.

A rule that mirrors one of verl's checks names it (``needs=("code:NAME",)``) and runs only where the verl in use
has that check as live code: a fork that commented an assertion out is not held to it, and a check added in 0.9
does not fire on 0.1. Where a release still ships the legacy workers (``verl/workers/fsdp_workers.py``, the
default up to 0.7), the engine workers' checks are not the ones its launches meet, and are not counted.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.inputs.knowledge import cached_fact
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_package_dir

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SEARCHED = ("utils", "trainer", "workers", "models")
"""The parts of verl whose code validates a config or runs it, the earliest checks first (``validate_config``)."""
ENGINE_PATH = ("workers/engine_workers.py", "workers/engine/", "workers/utils/")
"""The engine workers' code: not what a launch meets in a release whose default is still the legacy workers."""
LEGACY_WORKERS = "workers/fsdp_workers.py"
SITE_FORMAT = 2
"""Bumped when the shape of a cached site changes."""


@dataclass(frozen=True)
class Probe:
    """One of verl's checks, as found in its source: a live site that mentions every word of one alternative.

    ``kind`` is ``check`` (an ``assert``, or an ``if`` whose body raises), ``assign:ATTR`` (an assignment to
    ``.ATTR``) or ``call:NAME`` (a call of ``NAME``). Words are the names, attributes, words of string constants,
    comparison operators (``IsNot``, ``Mod``...), ``None`` and the file's stem; ``absent`` words must not appear.
    """

    what: str
    alternatives: tuple[frozenset[str], ...]
    kind: str = "check"
    absent: frozenset[str] = frozenset()


def _probe(what: str, *alternatives: str, kind: str = "check", absent: str = "") -> Probe:
    return Probe(what, tuple(frozenset(a.split()) for a in alternatives), kind, frozenset(absent.split()))


PROBES: dict[str, Probe] = {
    "train-batch-divisible": _probe(
        "check that the step's sequences divide the GPUs", "real_train_batch_size"
    ),
    "megatron-minimal-batch": _probe("Megatron minimal-batch check", "real_train_batch_size minimal_bsz"),
    "actor-mini-le-train": _probe(
        "check that the actor's mini batch fits in a step", "train_batch_size ppo_mini_batch_size actor"
    ),
    "critic-mini-le-train": _probe(
        "check that the critic's mini batch fits in a step", "train_batch_size ppo_mini_batch_size critic"
    ),
    "actor-micro-pair": _probe(
        "check of the actor's micro-batch keys", "ppo_micro_batch_size ppo_micro_batch_size_per_gpu actor"
    ),
    "rollout-micro-pair": _probe(
        "check of the log-prob micro-batch keys",
        "log_prob_micro_batch_size log_prob_micro_batch_size_per_gpu rollout",
    ),
    "ref-micro-pair": _probe(
        "check of the reference micro-batch keys",
        "log_prob_micro_batch_size log_prob_micro_batch_size_per_gpu ref",
    ),
    "critic-micro-pair": _probe(
        "check of the critic's micro-batch keys", "ppo_micro_batch_size ppo_micro_batch_size_per_gpu critic"
    ),
    "deprecated-micro-converted": _probe(
        "conversion of the deprecated global micro batch into the per-GPU one",
        "ppo_micro_batch_size",
        kind="assign:ppo_micro_batch_size_per_gpu",
    ),
    "per-gpu-micro-asserted": _probe(
        "assertion that the per-GPU micro batch is set",
        "ppo_micro_batch_size_per_gpu actor IsNot None",
        absent="ppo_micro_batch_size",
    ),
    "dynamic-bsz-equal": _probe(
        "check that actor and log-prob agree on dynamic batch size",
        "use_dynamic_bsz log_prob_use_dynamic_bsz",
    ),
    "deprecated-micro-divides": _probe(
        "check of the actor's deprecated micro batch against its mini batch",
        "ppo_mini_batch_size ppo_micro_batch_size Mod actor",
        "ppo_mini_batch_size ppo_micro_batch_size Mod dp_actor",
    ),
    "deprecated-micro-sp": _probe(
        "check of the actor's deprecated micro batch against the GPUs",
        "ppo_micro_batch_size sp_size n_gpus actor",
    ),
    "critic-deprecated-micro-divides": _probe(
        "check of the critic's deprecated micro batch against its mini batch",
        "ppo_mini_batch_size ppo_micro_batch_size Mod critic",
        "ppo_mini_batch_size ppo_micro_batch_size Mod dp_critic",
    ),
    "critic-deprecated-micro-sp": _probe(
        "check of the critic's deprecated micro batch against the GPUs",
        "ppo_micro_batch_size sp_size n_gpus critic",
    ),
    "mini-per-dp": _probe(
        "check that a mini batch splits over the data-parallel ranks",
        "mini_batch_size get_data_parallel_size",
    ),
    "micro-divides-mini": _probe(
        "check that the micro batch divides the per-GPU mini batch",
        "ppo_mini_batch_size ppo_micro_batch_size_per_gpu Mod",
        "micro_batch_size_per_gpu divisible",
    ),
    "micro-divides-batch": _probe(
        "check that micro batches divide the batch a rank scores",
        "micro_batch_size_per_gpu divisible",
    ),
    "loss-agg-mode": _probe("loss_agg_mode check", "loss_agg_mode"),
    "val-temperature": _probe("check of the validation sampling temperature", "do_sample temperature"),
    "vllm-lora-rank": _probe("check of vLLM's LoRA rank limit", "", kind="call:get_vllm_max_lora_rank"),
    "router-replay": _probe("router replay check", "router_replay"),
    "megatron-dtype": _probe("Megatron engine dtype check", "dtype bfloat16 float16"),
    "sp-remove-padding": _probe(
        "check that sequence parallelism removes padding",
        "use_remove_padding ulysses_sequence_parallel_size",
        "use_remove_padding sequence",
    ),
    "ulysses-heads": _probe(
        "check that the Ulysses size divides the attention heads", "num_attention_heads ulysses_sp_size"
    ),
    "rollout-world": _probe(
        "rollout world-size check", "infer_world_size world_size divisible", "world_size infer_tp divisible"
    ),
    "rollout-nodes": _probe("rollout replica node check", "world_size gpus_per_node divisible"),
    "rollout-config": _probe("RolloutConfig checks", "expert_parallel_size"),
    "rollout-sync-removed": _probe(
        "check that the sync rollout mode is gone", "mode sync removed", "mode sync async"
    ),
    "rollout-disaggregation": _probe("rollout disaggregation check", "disaggregation"),
    "rollout-moe-tp": _probe("check that MoE tensor parallel is trtllm's", "moe_tensor_parallel_size trtllm"),
}
"""Every check a rule may need, by name (``code:NAME``)."""


@dataclass(frozen=True)
class Site:
    """Where a release makes one check: file (under ``verl/``), line, the function, its string constants, and
    the words of the ``if`` conditions it is inside (``use_dynamic_bsz``: it runs only on one side of that)."""

    file: str
    line: int
    function: str
    strings: tuple[str, ...]
    guards: tuple[str, ...] = ()


@verl_cache
def verl_checks() -> dict[str, Site | None]:
    """Each probe's first live site in the verl in use (None: it does not make that check); cached on disk,
    under a name that changes with the probe table."""
    table = {
        n: [p.kind, sorted(p.absent), sorted(sorted(a) for a in p.alternatives)] for n, p in PROBES.items()
    }
    digest = hashlib.sha256(json.dumps([SITE_FORMAT, table], sort_keys=True).encode()).hexdigest()[:12]
    raw: dict[str, Any] = cached_fact(f"checks-{digest}", lambda: find_checks(verl_package_dir()))
    return {name: _site(value) for name, value in raw.items()}


def _site(value: list[Any] | None) -> Site | None:
    if not value:
        return None
    return Site(str(value[0]), int(value[1]), str(value[2]), tuple(value[3]), tuple(value[4]))


def verl_check(name: str) -> Site | None:
    """The site of the check ``name`` in the verl in use (a ``PROBES`` key), or None."""
    if name not in PROBES:
        raise ValueError(f"unknown verl check {name!r}")
    return verl_checks().get(name)


def find_checks(package: Path) -> dict[str, list[Any] | None]:
    """Each probe's first live site in ``package`` (JSON-ready: ``[file, line, function, strings]`` or None)."""
    found: dict[str, list[Any] | None] = dict.fromkeys(PROBES)
    anchors = _anchors()
    for rel, path in _files(package):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not any(anchor in text for anchor in anchors):
            continue
        sites = _sites(text, rel)
        for name, probe in PROBES.items():
            if found[name] is None:
                site = next((s for s in sites if _matches(probe, s)), None)
                if site is not None:
                    found[name] = [rel, site.line, site.function, list(site.strings), sorted(site.guards)]
    return found


@dataclass(frozen=True)
class _Site:
    kind: str
    line: int
    function: str
    words: frozenset[str]
    strings: tuple[str, ...]
    guards: frozenset[str]


def _matches(probe: Probe, site: _Site) -> bool:
    if site.kind != probe.kind or probe.absent & site.words:
        return False
    return any(words <= site.words for words in probe.alternatives)


def _files(package: Path) -> list[tuple[str, Path]]:
    legacy = (package / LEGACY_WORKERS).is_file()
    out: list[tuple[str, Path]] = []
    for top in SEARCHED:
        for root, dirs, files in os.walk(package / top):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "tests", "third_party"))
            for name in sorted(f for f in files if f.endswith(".py")):
                path = Path(root) / name
                rel = path.relative_to(package).as_posix()
                if not (legacy and rel.startswith(ENGINE_PATH)):
                    out.append((rel, path))
    return out


def _anchors() -> set[str]:
    """One word of each alternative (its longest) or the called name: a file without any holds no site."""
    out: set[str] = set()
    for probe in PROBES.values():
        out.update(max(words, key=len) for words in probe.alternatives if words)
        if probe.kind.startswith(("call:", "assign:")):
            out.add(probe.kind.partition(":")[2])
    return out


def _sites(text: str, rel: str) -> list[_Site]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    visitor = _Visitor(Path(rel).stem)
    visitor.visit(tree)
    return visitor.sites


class _Visitor(ast.NodeVisitor):
    """Collects the check sites of one module, each with the qualified name of the function it is in."""

    def __init__(self, stem: str) -> None:
        self.stem = stem
        self.stack: list[str] = []
        self.sites: list[_Site] = []
        self.named: list[dict[str, ast.AST]] = [{}]
        self.guards: list[frozenset[str]] = []
        """The words of each ``if`` condition the visitor is inside (the innermost last)."""
        """Per scope: names bound to a literal list, tuple or set (what a check compares against by name)."""

    def _add(self, kind: str, line: int, *nodes: ast.AST) -> None:
        words, strings = {self.stem}, []
        for node in nodes:
            for sub in ast.walk(node):
                words.update(_words(sub))
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    strings.append(sub.value)
        guards = frozenset().union(*self.guards) if self.guards else frozenset()
        self.sites.append(_Site(kind, line, ".".join(self.stack), frozenset(words), tuple(strings), guards))

    def _scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.named.append({})
        outer, self.guards = self.guards, []
        self.generic_visit(node)
        self.guards = outer
        self.named.pop()
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Assert(self, node: ast.Assert) -> None:
        self._add("check", node.lineno, node)
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        raises = [stmt for stmt in node.body if isinstance(stmt, ast.Raise)]
        if raises:
            self._add("check", node.lineno, node.test, *raises, *self._lists(node.test))
        self.visit(node.test)
        self.guards.append(frozenset().union(*(_words(sub) for sub in ast.walk(node.test))))
        for stmt in [*node.body, *node.orelse]:
            self.visit(stmt)
        self.guards.pop()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        self._add(f"call:{name}", node.lineno, node)
        if "check" in name or "valid" in name:
            self._add("check", node.lineno, node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Attribute):
                self._add(f"assign:{target.attr}", node.lineno, node.value)
            elif isinstance(target, ast.Name) and isinstance(node.value, ast.List | ast.Tuple | ast.Set):
                self.named[-1][target.id] = node.value
        self.generic_visit(node)

    def _lists(self, test: ast.expr) -> list[ast.AST]:
        """The literal lists a check compares against by name (``x not in valid_modes``), from the nearest scope."""
        out: list[ast.AST] = []
        for sub in ast.walk(test):
            if isinstance(sub, ast.Name):
                bound = next((scope[sub.id] for scope in reversed(self.named) if sub.id in scope), None)
                if bound is not None:
                    out.append(bound)
        return out


def _words(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Constant):
        return (
            set(_WORD.findall(node.value))
            if isinstance(node.value, str)
            else {"None"}
            if node.value is None
            else set()
        )
    if isinstance(node, ast.Compare):
        return {type(op).__name__ for op in node.ops}
    if isinstance(node, ast.BinOp):
        return {type(node.op).__name__}
    return set()

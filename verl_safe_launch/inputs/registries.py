"""The names verl looks up in its registries, read statically (``ast``) from the source of the verl in use.

A registry is filled by a registration decorator (``@register_adv_est("grpo")``), an enum of names, a table
(``_ROLLOUT_REGISTRY = {("vllm", "async"): ...}``) or a ``X.register("name", ...)`` call; the tables below say
which ones fill which registry. Nothing of verl is imported.
"""

from __future__ import annotations

import ast
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.inputs.knowledge import cached_fact
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_package_dir


@dataclass(frozen=True)
class Registry:
    """One registry: the config keys whose value verl looks up in it, and what fills it."""

    name: str
    keys: tuple[str, ...]
    decorators: tuple[str, ...] = ()
    """Registration decorators, as ``module:function`` (the module that defines the function)."""
    enums: tuple[str, ...] = ()
    """Enum classes whose string values are names (``module:Class``)."""
    tables: tuple[str, ...] = ()
    """Dict tables keyed by name, or by a tuple whose first item is the name (``module:NAME``)."""
    calls: tuple[str, ...] = ()
    """Class methods called with the name first (``module:Class.method``)."""
    compared: tuple[str, ...] = ()
    """Attributes compared with a name before the lookup (``config.loss_mode == "vanilla"``): names too."""

    def sources(self) -> tuple[str, ...]:
        """Every ``module:name`` that fills this registry."""
        return (*self.decorators, *self.enums, *self.tables, *self.calls)

    def may_fill(self, module: str, text: str) -> bool:
        """A cheap test that a file could fill this registry: it names one of the filling functions' homes."""
        for source in self.sources():
            home, _, name = source.partition(":")
            package = home.rpartition(".")[0]
            local = name.split(".")[0]
            if local in text and (module.startswith(package) or package.rpartition(".")[2] in text):
                return True
        return any(attr in text for attr in self.compared)


REGISTRIES: tuple[Registry, ...] = (
    Registry(
        "advantage estimator",
        ("algorithm.adv_estimator",),
        decorators=("verl.trainer.ppo.core_algos:register_adv_est",),
        enums=("verl.trainer.ppo.core_algos:AdvantageEstimator",),
    ),
    Registry(
        "policy loss",
        ("actor_rollout_ref.actor.policy_loss.loss_mode",),
        decorators=("verl.trainer.ppo.core_algos:register_policy_loss",),
        compared=("loss_mode",),
    ),
    Registry(
        "reward manager",
        ("reward.reward_manager.name", "reward_model.reward_manager"),
        decorators=(
            "verl.workers.reward_manager.registry:register",
            "verl.experimental.reward_loop.reward_manager.registry:register",
        ),
    ),
    Registry(
        "rollout",
        ("actor_rollout_ref.rollout.name",),
        tables=("verl.workers.rollout.base:_ROLLOUT_REGISTRY",),
        calls=("verl.workers.rollout.replica:RolloutReplicaRegistry.register",),
        compared=("rollout.name", "rollout_name"),
    ),
    Registry(
        "agent loop",
        ("actor_rollout_ref.rollout.agent.default_agent_loop",),
        decorators=("verl.experimental.agent_loop.agent_loop:register",),
    ),
)


def module_of(path: Path, root: Path) -> str:
    """``verl/trainer/ppo/core_algos.py`` → ``verl.trainer.ppo.core_algos`` (``root`` holds the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Local name → ``module:name`` for every ``from X import name`` (relative imports resolved)."""
    out: dict[str, str] = {}
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level:
            anchor = base[: len(base) - node.level + 1]
            source = ".".join([*anchor, source] if source else anchor)
        for alias in node.names:
            out[alias.asname or alias.name] = f"{source}:{alias.name}"
    return out


def _defines(origin: str, wanted: str) -> bool:
    """True when ``origin`` (``pkg:name`` as imported) is ``wanted`` itself or its re-export by a parent package."""
    module, _, name = origin.partition(":")
    want_module, _, want_name = wanted.partition(":")
    return name == want_name.split(".")[0] and (module == want_module or want_module.startswith(module + "."))


def _text(node: ast.expr, enums: dict[str, dict[str, str]]) -> str | None:
    """A name given as a string literal or as an enum member (``AdvantageEstimator.GRPO``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return enums.get(node.value.id, {}).get(node.attr)
    if isinstance(node, ast.Tuple) and node.elts:
        return _text(node.elts[0], enums)
    return None


def _enum_members(tree: ast.Module) -> dict[str, dict[str, str]]:
    """Class name → member → string value, for every class with string-valued attributes."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            members = {
                item.targets[0].id: item.value.value
                for item in node.body
                if isinstance(item, ast.Assign)
                and isinstance(item.targets[0], ast.Name)
                and isinstance(item.value, ast.Constant)
                and isinstance(item.value.value, str)
            }
            if members:
                out[node.name] = members
    return out


def _resolve(name: str, module: str, imports: dict[str, str]) -> str:
    """``module:name`` of a local name: imported, else defined in this module."""
    return imports.get(name, f"{module}:{name}")


def _names_in(
    tree: ast.Module, module: str, is_package: bool, registry: Registry
) -> tuple[set[str], set[str]]:
    """The names one file registers in ``registry``, and the names it compares before the lookup."""
    imports = _imported(tree, module, is_package)
    enums = _enum_members(tree)
    found: set[str] = set()
    compared: set[str] = set()
    for wanted in registry.enums:
        want_module, _, cls = wanted.partition(":")
        if module == want_module:
            found.update(enums.get(cls, {}).values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            local = func.id if isinstance(func, ast.Name) else None
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                local = f"{func.value.id}.{func.attr}"
            if local is None:
                continue
            origin = _resolve(local.split(".")[0], module, imports) + local[len(local.split(".")[0]) :]
            targets = registry.decorators if "." not in local else registry.calls
            if any(_defines(origin, want) for want in targets):
                name = _text(node.args[0], enums)
                if name is not None:
                    found.add(name)
        if isinstance(node, ast.Compare) and _compares(node, registry.compared):
            compared.update(t for c in node.comparators if (t := _text(c, enums)))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name) and f"{module}:{target.id}" in registry.tables:
                    found.update(t for k in node.value.keys if k is not None and (t := _text(k, enums)))
    return found, compared


def _compares(node: ast.Compare, attributes: tuple[str, ...]) -> bool:
    """``x.loss_mode == "..."``, ``self.config.rollout.name == "hf"``, ``rollout_name == "hf"``: an equality test
    of a name or attribute chain that ends with one of ``attributes`` (dotted for a chain)."""
    parts: list[str] = []
    left = node.left
    while isinstance(left, ast.Attribute):
        parts.insert(0, left.attr)
        left = left.value
    if isinstance(left, ast.Name):
        parts.insert(0, left.id)
    chain = ".".join(parts)
    return (
        bool(parts)
        and all(isinstance(op, ast.Eq) for op in node.ops)
        and any(chain == attr or chain.endswith("." + attr) for attr in attributes)
    )


def read_registries(root: Path) -> dict[str, list[str]]:
    """Registry name → every name the verl package under ``root`` registers (an empty list: it has none)."""
    names: dict[str, set[str]] = {r.name: set() for r in REGISTRIES}
    compared: dict[str, set[str]] = {r.name: set() for r in REGISTRIES}
    for directory, dirs, files in os.walk(root / "verl"):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "tests"))
        for file in sorted(f for f in files if f.endswith(".py")):
            path = Path(directory, file)
            text = path.read_text(encoding="utf-8", errors="replace")
            module = module_of(path, root)
            wanted = [r for r in REGISTRIES if r.may_fill(module, text)]
            if not wanted:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for registry in wanted:
                found, tested = _names_in(tree, module, file == "__init__.py", registry)
                names[registry.name] |= found
                compared[registry.name] |= tested
    # Names compared before the lookup complete a registry, never make one: alone they may be a few of many.
    return {name: sorted(found | compared[name]) if found else [] for name, found in names.items()}


@verl_cache
def registered_names() -> dict[str, frozenset[str]]:
    """Registry name → the names the verl in use registers (cached on disk per release)."""
    root = verl_package_dir().parent
    digest = hashlib.sha256(repr(REGISTRIES).encode()).hexdigest()[:12]  # a new table reads the names again
    data = cached_fact(f"registries-{digest}", lambda: read_registries(root))
    return {name: frozenset(found) for name, found in data.items()}


ESTIMATOR_HOMES = ("verl/trainer/ppo/core_algos.py", "verl/trainer/ppo/ray_trainer.py")
"""Where releases define their advantage estimators: registered functions (0.4 on) or the branches of
``compute_advantage`` (0.1 to 0.3)."""


def _has_index(fn: ast.FunctionDef) -> bool:
    args = fn.args
    return any(a.arg == "index" for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))


def _registered_group(tree: ast.Module, enums: dict[str, dict[str, str]]) -> dict[str, ast.FunctionDef]:
    """``@register_adv_est(NAME)`` functions that take the group ``index``, by name."""
    found: dict[str, ast.FunctionDef] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or not _has_index(node):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.args):
                continue
            if dec.func.id == "register_adv_est" and (name := _text(dec.args[0], enums)):
                found[name] = node
    return found


def _raises_on_one(fn: ast.FunctionDef) -> bool:
    """The function raises when a group holds fewer than two responses: ``if N < 2: raise`` (or ``N == 1``,
    ``N <= 1``), as verl 0.9.1's pass@k estimator does."""
    for node in ast.walk(fn):
        if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
            continue
        test = node.test
        if len(test.ops) != 1 or not isinstance(test.comparators[0], ast.Constant):
            continue
        op, bound = test.ops[0], test.comparators[0].value
        one = (isinstance(op, ast.Lt) and bound == 2) or (isinstance(op, ast.Eq | ast.LtE) and bound == 1)
        if one and any(isinstance(stmt, ast.Raise) for stmt in node.body):
            return True
    return False


def _branch_group(tree: ast.Module, enums: dict[str, dict[str, str]]) -> set[str]:
    """Estimators whose ``if adv_estimator == NAME`` branch in ``compute_advantage`` passes ``index=``."""
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name != "compute_advantage":
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
                continue
            test = node.test
            if not (isinstance(test.left, ast.Name) and test.left.id == "adv_estimator"):
                continue
            names = [t for c in test.comparators if (t := _text(c, enums))]
            calls = [c for stmt in node.body for c in ast.walk(stmt) if isinstance(c, ast.Call)]
            if any(k.arg == "index" for c in calls for k in c.keywords):
                found.update(names)
    return found


def _estimator_trees(root: Path) -> tuple[list[ast.Module], dict[str, dict[str, str]]]:
    trees = []
    enums: dict[str, dict[str, str]] = {}
    for home in ESTIMATOR_HOMES:
        path = root / home
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError):
            continue
        trees.append(tree)
        enums.update(_enum_members(tree))
    return trees, enums


def read_group_estimators(root: Path) -> list[str]:
    """Advantage estimators of the verl package under ``root`` that compare the responses to one prompt: their
    function takes the group ``index`` (with one response per prompt there is no group; verl gives it the baseline 0)."""
    found: set[str] = set()
    trees, enums = _estimator_trees(root)
    for tree in trees:
        found |= set(_registered_group(tree, enums)) | _branch_group(tree, enums)
    return sorted(found)


def read_group_of_one_raises(root: Path) -> list[str]:
    """The group estimators of the verl package under ``root`` whose function raises on a group of one response."""
    trees, enums = _estimator_trees(root)
    return sorted(
        name for tree in trees for name, fn in _registered_group(tree, enums).items() if _raises_on_one(fn)
    )


@verl_cache
def group_of_one_raises() -> frozenset[str]:
    """``read_group_of_one_raises`` of the verl in use (cached on disk per release)."""
    root = verl_package_dir().parent
    return frozenset(cached_fact("group_of_one_raises", lambda: read_group_of_one_raises(root)))


@verl_cache
def group_estimators() -> frozenset[str]:
    """The group advantage estimators of the verl in use (cached on disk per release)."""
    root = verl_package_dir().parent
    return frozenset(cached_fact("group_estimators", lambda: read_group_estimators(root)))


ENGINE_CALLS = ("LLM(", "EngineArgs(", "AsyncLLM", "build_async_engine")
"""What a vLLM rollout module writes where it builds the engine."""


def read_max_model_len_paths(root: Path) -> dict[str, bool]:
    """Per vLLM rollout module of the verl package under ``root`` that builds the engine: whether it hands the
    engine the config's ``max_model_len`` (a module that derives the length itself, from the prompt and response
    lengths, does not). A copy that picks its module by the installed vLLM's version (verl 0.2, its forks) can
    disagree with itself."""
    found: dict[str, bool] = {}
    folder = root / "verl" / "workers" / "rollout" / "vllm_rollout"
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else ():
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if any(call in text for call in ENGINE_CALLS):
            found[path.name] = "config.max_model_len" in text
    return found


@verl_cache
def max_model_len_paths() -> dict[str, bool]:
    """``read_max_model_len_paths`` of the verl in use (cached on disk per release)."""
    root = verl_package_dir().parent
    return dict(cached_fact("max_model_len_paths", lambda: read_max_model_len_paths(root)))

"""Custom reward code: the file verl imports for the reward function (or manager) exists and defines the name.

verl loads it with ``load_extern_object`` (``utils/import_utils.py``) in the reward workers, after Ray and the
models are up: a missing file is ``FileNotFoundError``, a file that does not parse a ``RuntimeError``, a missing
name an ``AttributeError``. The file is read here with ``ast``, never run: a name bound in a way the reader cannot
follow (a star import, ``globals()``, ``setattr``, ``__getattr__``) is taken as possibly there.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Rule, Severity
from verl_safe_launch.rules.kit import Draft, check, kv

PKG, FILE = "pkg://", "file://"
CODE_KEYS = (
    ("reward.custom_reward_function.path", "reward.custom_reward_function.name"),
    ("reward.reward_manager.module.path", "reward.reward_manager.module.name"),
)
MANAGER_SOURCE = "reward.reward_manager.source"
MAX_SOURCE_BYTES = 8 * 1024 * 1024


@functools.lru_cache(maxsize=32)
def _names(path: str, stamp: tuple[float, int]) -> frozenset[str] | str | None:
    """The module-level names of a Python file; the reason when it does not parse; None when any name could be
    bound in a way the reader cannot follow."""
    del stamp  # part of the cache key: a rewritten file is read again
    try:
        with open(path, "rb") as handle:
            source = handle.read(MAX_SOURCE_BYTES + 1)
        if len(source) > MAX_SOURCE_BYTES:
            return None
        tree = ast.parse(source, path)
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return None
        if isinstance(node, ast.Name) and node.id in ("globals", "setattr", "exec", "__getattr__"):
            return None
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return None
    for stmt in tree.body:
        names.update(_bound(stmt))
    return frozenset(names)


def _bound(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement binds (and those of the blocks under an if/try at the top level)."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(stmt, ast.If | ast.Try | ast.With):
        blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
        blocks += [h.body for h in getattr(stmt, "handlers", [])]
        return {name for block in blocks for inner in block for name in _bound(inner)}
    return set()


@check("reward-code-missing", "a custom reward file exists and defines the function verl imports from it")
def reward_code(ctx: RuleContext) -> list[Draft]:
    """The file and the name verl loads when its reward workers start, after the models are on the GPUs."""
    out: list[Draft] = []
    for path_key, name_key in CODE_KEYS:
        if path_key.startswith("reward.reward_manager") and ctx.view.get(MANAGER_SOURCE) != "importlib":
            continue  # a registered manager: verl never reads the module path
        path, name = ctx.view.get(path_key), ctx.view.get(name_key)
        if not isinstance(path, str) or not path or path.startswith(PKG):
            continue
        local = Path(path.removeprefix(FILE)).expanduser()
        here = ctx.hardware.on_this_machine
        severity = None if here else Severity.WARNING
        where = "" if here else " on this machine (cannot verify where the job runs)"
        if not local.is_file():
            what = "does not exist" if not local.exists() else "is not a regular file"
            message = (
                f"{kv(ctx.view, path_key)}: the file {what}{where}; verl imports it in its reward workers, after "
                "Ray and the models are up (FileNotFoundError)"
            )
            out.append(Draft((path_key,), message, (), severity, f"{path_key}=/path/to/your/reward.py"))
            continue
        st = local.stat()
        found = _names(str(local), (st.st_mtime, st.st_size))
        if isinstance(found, str):
            message = (
                f"{kv(ctx.view, path_key)}: the file does not parse ({found}); verl's import of it fails"
            )
            out.append(Draft((path_key,), message, (), severity, f"fix {path} so that python can import it"))
        elif found is not None and isinstance(name, str) and name not in found:
            defined = ", ".join(sorted(n for n in found if not n.startswith("_"))[:8]) or "nothing"
            message = (
                f"{kv(ctx.view, name_key)}: {path} defines no {name} at module level (it defines {defined}); "
                "verl's import stops there (AttributeError)"
            )
            fix = f"{name_key}=<the function's name in {path}>"
            out.append(Draft((name_key, path_key), message, (), severity, fix))
    return out


RULES: tuple[Rule[RuleContext], ...] = (reward_code,)

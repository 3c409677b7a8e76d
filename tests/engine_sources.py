"""The rollout engines' and Megatron's own code, as verl 0.9.1 pins them, for the tests that compare with it.

What is fetched (with pip, from the package index, once per cache directory):

- vLLM 0.24.0: its wheel is downloaded and only its Python files (and the JSON/Jinja data beside them) are
  unpacked, about 30 MB of the 280 MB wheel: the CUDA kernels are not needed to build vLLM's ModelConfig,
  ParallelConfig and QKVParallelLinear on a CPU. The few pure-Python packages its config modules import and
  this venv lacks are installed with ``pip install --no-deps --target`` beside it (``VLLM_CONFIG_DEPS``).
- megatron-core 0.18.0 (the ``core_v0.18.0`` verl 0.9.1's lock pins): its 2 MB wheel is published for
  Python 3.12 and up only; its Python code runs here on 3.11, so it is installed with ``--python-version 3.12``.
- SGLang 0.5.12: its 8 MB wheel, unpacked. SGLang cannot be imported without CUDA kernels, triton and
  torchvision, so the tests run the functions that hold its checks from this source (``run_method``).

The cache is ``$VSL_TEST_ENGINES``, else pytest's cache directory, else the session's temporary directory; a
lock file keeps parallel test workers from fetching the same thing twice.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import fcntl
import functools
import os
import subprocess
import sys
import types
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

VLLM = "vllm==0.24.0"
SGLANG = "sglang==0.5.12"
MEGATRON = "megatron-core==0.18.0"
VLLM_CONFIG_DEPS = (
    "cbor2==6.3.0",
    "openai-harmony==0.0.8",
    "openai==3.60.0",
    "httpx2==2.16.2",
    "einops==0.8.2",
    "pybase64==1.5.1",
    "uvloop==0.23.0",
    "py-cpuinfo==9.0.0",
)
UNPACKED = (".py", ".json", ".jinja", ".typed", "/METADATA", "/RECORD")
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "-q")


def cache_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the fetched code lives (shared by the test workers of one run, kept between runs if cached)."""
    given = os.environ.get("VSL_TEST_ENGINES")
    if given:
        return Path(given)
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("engines"))
    return tmp_path_factory.getbasetemp().parent / "engines"


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """One fetcher at a time across the xdist workers."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip(*args: str) -> None:
    subprocess.run([*PIP, *args], check=True, timeout=900, stdout=subprocess.DEVNULL)


def unpacked_wheel(root: Path, requirement: str, top: str) -> Path:
    """The wheel of ``requirement`` downloaded and its Python files (not its binaries) unpacked under ``root``."""
    target = root / requirement.replace("==", "-")
    if (target / top).is_dir():
        return target
    with locked(root):
        if (target / top).is_dir():
            return target
        download = root / "download"
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(download), requirement)
        (wheel,) = download.glob("*.whl")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.endswith(UNPACKED):
                    archive.extract(member, partial)
        wheel.unlink()
        partial.rename(target)
    return target


def installed(root: Path, name: str, requirements: tuple[str, ...], *extra: str) -> Path:
    """``pip install --no-deps --target`` of ``requirements`` under ``root/name`` (once)."""
    target = root / name
    if (target / ".done").is_file():
        return target
    with locked(root):
        if not (target / ".done").is_file():
            _pip("install", "--no-deps", "--target", str(target), *extra, *requirements)
            (target / ".done").write_text("")
    return target


def megatron_core(root: Path) -> Path:
    """megatron-core 0.18.0's package, installed for Python 3.12 (its code runs on this 3.11)."""
    extra = ("--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64")
    return installed(root, "megatron-core-0.18.0", (MEGATRON,), *extra)


def vllm_paths(root: Path) -> list[Path]:
    """What a subprocess puts on PYTHONPATH to import vLLM 0.24.0's config modules."""
    return [unpacked_wheel(root, VLLM, "vllm"), installed(root, "vllm-config-deps", VLLM_CONFIG_DEPS)]


def run_oracle(
    script: str, paths: list[Path], cases: list[dict[str, Any]], home: Path, cache: Path | None = None
) -> list[dict[str, Any]]:
    """Run ``tests/<script>`` in a fresh interpreter on ``cases`` (JSON in, one JSON verdict per case out).

    ``cache`` keeps vLLM's model-inspection cache between runs (it is keyed by the model's config).
    """
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(str(p) for p in paths),
        HOME=str(home),
        VLLM_CACHE_ROOT=str(cache or home / "vllm"),
        XDG_CACHE_HOME=str(home / "cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script))],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        cwd=home,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    verdicts: list[dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    return verdicts


class Reached(Exception):
    """The function went past the checks under test into a part of the engine the test does not load."""


@dataclass(frozen=True)
class Method:
    """One function or method of an engine's source file, compiled on its own with its real line numbers."""

    path: Path
    owner: str | None
    name: str

    def node(self) -> ast.FunctionDef:
        return _node(self.path, self.owner, self.name)

    def line_of(self, needle: str) -> int:
        """The last line of the smallest statement of the function whose source holds ``needle``."""
        text = self.path.read_text().splitlines()
        node = self.node()
        found = [
            stmt
            for stmt in ast.walk(node)
            if isinstance(stmt, ast.stmt)
            and stmt is not node
            and needle in "\n".join(text[stmt.lineno - 1 : stmt.end_lineno])
        ]
        assert found, f"{needle!r} is not in {self.path.name}:{self.name}"
        smallest = min(found, key=lambda stmt: (stmt.end_lineno or 0) - stmt.lineno)
        return smallest.end_lineno or smallest.lineno

    def compiled(self, names: dict[str, Any]) -> Callable[..., Any]:
        """The function, in a namespace holding only ``names`` (a method gets a class with a do-nothing base)."""
        func = self.node()
        flags = __future__.annotations.compiler_flag
        if self.owner is None:
            module = ast.Module(body=[func], type_ignores=[])
        else:
            host = ast.ClassDef(
                name=self.owner,
                bases=[ast.Name("_Base", ast.Load())],
                keywords=[],
                body=[func],
                decorator_list=[],
            )
            module = ast.Module(body=[host], type_ignores=[])
        ast.fix_missing_locations(module)
        namespace: dict[str, Any] = {"_Base": _Base, "__name__": f"engine_source.{self.path.stem}", **names}
        exec(compile(module, str(self.path), "exec", flags=flags, dont_inherit=True), namespace)
        return namespace[self.owner] if self.owner is not None else namespace[self.name]  # type: ignore[no-any-return]


@functools.cache
def _node(path: Path, owner: str | None, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    if owner is not None:
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
        body = cls.body
    (func,) = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    return func


class _Base:
    """What an engine class inherits here: nothing (its own ``__init__`` runs, the base's does not)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def stopped_at(exc: BaseException, method: Method) -> int | None:
    """The line of ``method`` the exception left it from (None when it did not pass through it)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == str(method.path) and code.co_name == method.name:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def refusal(call: Callable[[], Any], method: Method, last_check: int) -> str | None:
    """Run ``call``; the engine's refusal (its exception text) if it failed at or before ``last_check``.

    A ``Reached`` or ``NameError`` (a part of the engine not loaded here) after that line means every check
    under test passed; one before it means the test's namespace is missing something, which fails the test.
    """
    try:
        call()
    except (Reached, NameError, AttributeError) as exc:
        line = stopped_at(exc, method)
        assert line is not None and line > last_check, f"{method.name} stopped early, at line {line}: {exc!r}"
        return None
    except (AssertionError, ValueError, RuntimeError) as exc:
        line = stopped_at(exc, method)
        assert line is not None and line <= last_check, f"{method.name} failed past its checks: {exc!r}"
        return f"{type(exc).__name__}: {exc}"
    return None


def reach(*_args: Any, **_kwargs: Any) -> Any:
    """A part of the engine past the checks under test."""
    raise Reached


def namespace_module(name: str, **attrs: Any) -> types.SimpleNamespace:
    """A stand-in holding only the attributes a compiled function reads."""
    return types.SimpleNamespace(__name__=name, **attrs)


def up_to_checks(build: Callable[..., Any], method: Method, last_check: int) -> Callable[..., None]:
    """``build`` run only as far as its checks: a stop past ``last_check`` counts as built (nothing is returned);
    a refusal in the checks is raised to the caller, as the engine would."""

    def call(*args: Any, **kwargs: Any) -> None:
        try:
            build(*args, **kwargs)
        except (Reached, NameError, AttributeError) as exc:
            line = stopped_at(exc, method)
            assert line is not None and line > last_check, (
                f"{method.name} stopped early, at line {line}: {exc!r}"
            )

    return call

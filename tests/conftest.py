"""Shared fixtures: the CLI run in-process, and a tiny locally generated model directory (no download)."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from verl_safe_launch.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "launch_examples"
DATA = Path(__file__).resolve().parent / "data"
GOLDEN = Path(__file__).resolve().parent / "golden"

# Property tests: deterministic by default ("ci": a fixed derandomized search, no example database, so a run
# passes or fails the same way on every machine); VSL_HYPOTHESIS_PROFILE=fuzz explores freely for offline fuzzing,
# with random seeds, an example database under .hypothesis/ and FUZZ_FACTOR times the examples. A failure found
# while fuzzing is kept as an ``@example`` on its test, so the deterministic run checks it from then on.
FUZZ_FACTOR = 10
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, print_blob=True)
PROFILE = os.environ.get("VSL_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "fuzz"):
    raise pytest.UsageError(f"VSL_HYPOTHESIS_PROFILE={PROFILE!r}: use 'ci' (the default) or 'fuzz'")
settings.load_profile(PROFILE)


def examples(count: int) -> int:
    """How many examples a property test draws: ``count`` in CI, FUZZ_FACTOR times more when fuzzing."""
    return count * FUZZ_FACTOR if PROFILE == "fuzz" else count


@pytest.fixture(scope="session", autouse=True)
def _caches_in_test_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Caches that torch writes to TMPDIR or HOME by default (inductor's, triton's) go to this run's own dir."""
    with pytest.MonkeyPatch.context() as mp:
        caches = tmp_path_factory.mktemp("caches")
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(caches / "torchinductor"))
        mp.setenv("TRITON_CACHE_DIR", str(caches / "triton"))
        # pip runs `rustc --version` for its user agent; where rustc is rustup's proxy, that writes ~/.rustup.
        mp.setenv("RUSTUP_HOME", str(caches / "rustup"))
        yield


@pytest.fixture(autouse=True)
def _no_verl_choice_left_behind() -> Iterator[None]:
    """A test that made another verl the one checks read (``--verl``, a project's vendored copy, in this process)
    leaves the installed one to the next test on this worker."""
    yield
    from verl_safe_launch.inputs import choose_verl, chosen_verl
    from verl_safe_launch.inputs.verl_paths import installed_verl

    for scope in ("user", "project"):
        chosen = chosen_verl(scope)
        if chosen is not None and chosen[0] != installed_verl()[0]:
            choose_verl(None, scope=scope)


@pytest.fixture(scope="session", autouse=True)
def knowledge_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What is derived from verl is cached in a temporary directory, never in the user's cache."""
    path = tmp_path_factory.mktemp("verl-knowledge")
    os.environ["XDG_CACHE_HOME"] = str(path)
    os.environ.pop("VSL_CACHE_DIR", None)
    return path


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``verl-safe-launch`` in-process: ``cli("show", "--origin")``."""

    def run(*argv: str) -> CliResult:
        code = main(list(argv))
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_tiny_model(path: Path, *, weights: bool = False, **config: object) -> Path:
    """Write a tiny Qwen2-style model directory: config.json plus a word-level tokenizer; with ``weights``, also
    randomly initialised weights saved by transformers (what verl's workers load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for word in [
        "the",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "it",
        "you",
        "that",
        "he",
        "was",
        "for",
        "on",
        "are",
        "with",
        "as",
        "I",
        "his",
        "they",
        "be",
        "at",
    ]:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": len(vocab), **config}))
    if weights:
        from transformers import AutoConfig, AutoModelForCausalLM

        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path)
    return path


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    """A tiny model directory (config.json + tokenizer) made in the test's temp dir."""
    return make_tiny_model(tmp_path / "tiny-model")


@contextlib.contextmanager
def short_temp_dir(prefix: str) -> Iterator[Path]:
    """A new directory in /tmp, removed afterwards: Ray's socket paths below it must fit in 107 bytes.

    Not in TMPDIR: a private TMPDIR (a CI's, a cluster's per-job one) is often too long for them.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fresh_ray_env(mp: pytest.MonkeyPatch, home: Path, tmpdir: Path | None = None) -> None:
    """Ray as on a fresh machine: no ``RAY_*`` variables and a HOME without ``~/.ray`` (Ray's default auth path).

    With ``tmpdir``, Ray's processes make their temporary files there (a killed one never removes its
    multiprocessing directory). The auth variables Ray itself sets while starting are put back (removed) when
    ``mp`` is undone.
    """
    home.mkdir(parents=True, exist_ok=True)
    if tmpdir is not None:
        mp.setenv("TMPDIR", str(tmpdir))
    for name in {*(n for n in os.environ if n.startswith("RAY_")), "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}:
        mp.setenv(name, "")  # recorded, so that undo restores the variable as it was (or removes it)
        mp.delenv(name)
    mp.setenv("HOME", str(home))


def check_golden(name: str, actual: str) -> None:
    """Compare with ``tests/golden/NAME``; on mismatch print the diff and how to accept (VSL_UPDATE_GOLDEN=1)."""
    path = GOLDEN / name
    if os.environ.get("VSL_UPDATE_GOLDEN") == "1":
        path.write_text(actual)
    expected = path.read_text() if path.exists() else ""
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), str(path), "actual")
        )
        pytest.fail(
            f"{name} differs from its golden file:\n{diff}\naccept with: VSL_UPDATE_GOLDEN=1 pytest tests/"
        )


VERL_RELEASES = ("0.5.0", "0.6.1", "0.7.1", "0.8.0")
"""The releases the per-release tests install with ``pip install --no-deps --target``."""


@pytest.fixture(scope="session")
def releases(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with one ``pip --target`` install per release (``$VSL_TEST_VERL_RELEASES``, else the pytest
    cache), made on first use; a lock keeps parallel workers from installing into one directory at once."""
    from filelock import FileLock

    given = os.environ.get("VSL_TEST_VERL_RELEASES")
    cache = getattr(
        request.config, "cache", None
    )  # None under -p no:cacheprovider: the run's shared temp dir
    if given:
        base = Path(given)
    elif cache is not None:
        base = Path(cache.mkdir("verl-releases"))
    else:
        base = tmp_path_factory.getbasetemp().parent / "verl-releases"
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base / ".install.lock")):
        for version in VERL_RELEASES:
            target = base / version
            if not (target / "verl" / "version" / "version").is_file():
                shutil.rmtree(target, ignore_errors=True)  # a half-made install of an interrupted run
                cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
                subprocess.run([*cmd, f"verl=={version}"], check=True, timeout=600)
    return base


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked slow run first: under pytest-xdist they then run beside the quick ones, not after them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

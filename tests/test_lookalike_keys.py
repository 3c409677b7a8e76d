"""Keys are what they look like: a key holding invisible or look-alike characters that reads as one of verl's
keys is an error naming the code points, and every text output shows Unicode's format characters as escapes.

The key set is verl's real config (its YAML and dataclasses, read through the pre-flight); which characters are
format characters is Python's own Unicode database.
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult

from verl_safe_launch.render import escape, escape_hidden

GRPO = str(EXAMPLES / "grpo_6gpu.yaml")
FORMAT = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]


def test_every_format_character_is_shown_as_an_escape() -> None:
    assert FORMAT  # the Unicode database has them
    for char in FORMAT:
        for shown in (escape(f"a{char}b"), escape_hidden(f"a{char}b")):
            assert char not in shown and shown.startswith("a\\") and shown.endswith("b"), hex(ord(char))


@pytest.mark.parametrize(
    ("written", "named"),
    [
        ("train_batch_size\u200b", "U+200B ZERO WIDTH SPACE"),
        ("\ufefftrain_batch_size", "U+FEFF ZERO WIDTH NO-BREAK SPACE"),
        ("train_\u00adbatch_size", "U+00AD SOFT HYPHEN"),
        ("train_batch\u061c_size", "U+061C ARABIC LETTER MARK"),
        ("train_batch_size\u200f", "U+200F RIGHT-TO-LEFT MARK"),
        ("train_batch_size\U000e0041", "U+E0041 TAG LATIN CAPITAL LETTER A"),
        ("train_batch_size\ufff9", "U+FFF9 INTERLINEAR ANNOTATION ANCHOR"),
        ("tra\u0456n_batch_size", "U+0456 CYRILLIC SMALL LETTER BYELORUSSIAN-UKRAINIAN I"),
        ("tr\u0430in_batch_size", "U+0430 CYRILLIC SMALL LETTER A"),
        ("\uff54rain_batch_size", "U+FF54 FULLWIDTH LATIN SMALL LETTER T"),
    ],
)
def test_a_key_drawn_like_a_real_one_is_an_error_naming_its_code_points(
    cli: Callable[..., CliResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, named: str
) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    layer = tmp_path / "layer.yaml"
    layer.write_text(f"data:\n  {written}: 64\n", encoding="utf-8")
    result = cli("check", "-c", GRPO, "-c", str(layer), "hardware.gpu_memory_gb=80")
    assert result.code == 1, result.out + result.err
    lines = (result.out + result.err).splitlines()
    error = next(line for line in lines if line.startswith("error [lookalike-key]"))
    assert named in error and "prints like data.train_batch_size" in error
    assert "fix: data.train_batch_size=64" in result.out + result.err
    assert not any("[new-key]" in line and "train" in line for line in lines)
    assert all(c not in result.out + result.err for c in FORMAT)


def test_a_new_key_of_plain_letters_is_still_only_a_warning(
    cli: Callable[..., CliResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    layer = tmp_path / "layer.yaml"
    layer.write_text("data:\n  train_batch_sise: 64\n", encoding="utf-8")
    result = cli("check", "-c", GRPO, "-c", str(layer), "hardware.gpu_memory_gb=80")
    assert "warning [new-key] data.train_batch_sise" in result.out + result.err
    assert "lookalike-key" not in result.out + result.err


@pytest.mark.parametrize("key", ["data.train_batch_size\u200b", "data.tra\u0456n_batch_size"])
def test_a_look_alike_key_on_the_command_line_is_refused_by_hydras_own_parser_and_shown_escaped(
    cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    result = cli("check", "-c", GRPO, f"{key}=64", "hardware.gpu_memory_gb=80")
    assert result.code == 2, result.out + result.err
    assert f"error: invalid override '{escape(key)}=64': token recognition error" in result.err
    assert "\u200b" not in result.out + result.err

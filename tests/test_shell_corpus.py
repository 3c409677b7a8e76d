"""The script reader against ``bash -n`` on a generated corpus: what bash reads, we read.

Quoting inside here-documents, command substitutions, ``case`` and comments, every body in every container (an
enumerated grid, the same in every run). A script ``bash -n`` passes must never be refused as unreadable.
"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from verl_safe_launch.errors import InputError
from verl_safe_launch.shell import parse_script

LAUNCH = "python3 -m verl.trainer.main_ppo trainer.nnodes=1"

BODIES = [
    "it's fine",
    'say "hi"',
    "a ) b",
    "x ( y",
    "$(date)",
    "`date`",
    "# it's a comment",
    "${HOME}",
    "esac",
    "case x in",
    "back\\slash",
    "'",
    '"',
    "))",
    "$((1 << 2))",
    "EOFX",
]

WORDS = [
    "it\\'s",
    "'a)b'",
    '"a)b"',
    "\\)",
    "a#b",
    "$((1+2))",
    '"it\'s"',
    "'say \"x\"'",
    "$'it\\'s'",
    "`echo a`",
    "\"$(echo ')')\"",
    "'",
    ")",
]

BODY_CONTAINERS = [
    "x=$(cat <<EOF\n{}\nEOF\n)",
    "x=$(cat <<'EOF'\n{}\nEOF\n)",
    'x=$(cat <<"EOF"\n{}\nEOF\n)',
    "x=$(cat <<-EOF\n\t{}\n\tEOF\n)",
    'x="$(cat <<EOF\n{}\nEOF\n)"',
    "x=$(cat <<EOF | head -1\n{}\nEOF\n)",
    "x=$(cat <<A; cat <<B\n{}\nA\n{}\nB\n)",
    "x=$(echo $(cat <<EOF\n{}\nEOF\n))",
    "x=$( # {}\necho hi)",
    "x=$(echo hi # {}\n)",
    "cat <<EOF\n{}\nEOF",
    "x=$(echo '{}')",
]

WORD_CONTAINERS = [
    'x=$(case "$1" in a) echo {};; b|c) echo two;; *) echo other;; esac)',
    "x=$(case $1 in (a) echo {};; esac)",
    "x=$(case $1 in\n  a) echo {}\n  ;;\nesac\n)",
    "x=$(case $1 in a) case $2 in b) echo {};; esac;; esac)",
    "x=$(echo {})",
    'x="$(echo {})"',
    "x=${{Y:-$(echo {})}}",
    "x=$(echo $(( 1 << 2 )) {})",
    "x=$( (echo {}) )",
    "x=`echo {}`",
]


def _corpus() -> list[str]:
    scripts = [c.replace("{}", body) for c, body in itertools.product(BODY_CONTAINERS, BODIES)]
    scripts += [c.format(word) for c, word in itertools.product(WORD_CONTAINERS, WORDS)]
    return [f"#!/bin/bash\n{script}\n{LAUNCH}\n" for script in scripts]


def _bash_reads(scripts: list[str], tmp_path: Path) -> list[bool]:
    verdicts = []
    for n, script in enumerate(scripts):
        path = tmp_path / f"s{n}.sh"
        path.write_text(script)
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, check=False, timeout=30)
        verdicts.append(done.returncode == 0)
    return verdicts


def _we_read(script: str) -> bool:
    try:
        parse_script(script, "job.sh")
    except InputError as exc:
        return "cannot read" not in str(exc)
    return True


def test_every_script_bash_reads_is_read(tmp_path: Path) -> None:
    scripts = _corpus()
    bash = _bash_reads(scripts, tmp_path)
    refused = [s for s, ok in zip(scripts, bash, strict=True) if ok and not _we_read(s)]
    assert not refused, f"{len(refused)} scripts bash -n passes are refused, e.g.:\n{refused[0]}"
    assert sum(bash) > len(scripts) // 2, "the grid is mostly scripts bash reads"
    bad = [s for s, ok in zip(scripts, bash, strict=True) if not ok]
    assert bad and sum(not _we_read(s) for s in bad) >= len(bad) // 2, "and we still refuse what bash refuses"


@pytest.mark.parametrize(
    "head",
    [
        "head_cmd=$(cat <<EOF\necho it's fine\nEOF\n)",
        "COMMAND=$(cat <<'EOF'\nray start --head  # it's the head\nEOF\n)",
    ],
)
def test_a_here_document_in_a_substitution_keeps_the_launch_after_it(head: str) -> None:
    [launch] = parse_script(f"{head}\n{LAUNCH}\n", "ray.sub")
    assert [t.text for t in launch.tokens][-1] == "trainer.nnodes=1"

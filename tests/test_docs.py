"""The docs: a front-page README that links into docs/, and a site that MkDocs builds without a warning."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

from verl_safe_launch.cli import VERBS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# The set-up block: .ci/run and the tests depend on these two lines as written.
SETUP_LINES = (
    "bash .ci/setup-venv && .venv/bin/verl-safe-launch preset=auto hardware.nodes=1 hardware.gpus_per_node=6 "
    "hardware.gpu_memory_gb=80 -c launch_examples/grpo_preset.yaml   # the main job",
    "bash .ci/test   # the tests: ruff, ruff format --check, mypy --strict, pytest",
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _nav_pages(node: object) -> list[str]:
    """Every page named in an mkdocs nav (nested lists of ``{title: page-or-list}``)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#").strip()) for line in page.read_text().splitlines() if line.startswith("#")}


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml as mkdocs reads it: ``!ENV [NAME, default]`` is the default (the variable unset)."""


_MkdocsLoader.add_constructor("!ENV", lambda loader, node: loader.construct_sequence(node)[-1])
NAV = _nav_pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkdocsLoader)["nav"])


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_readme_keeps_the_two_setup_commands() -> None:
    text = README.read_text()
    assert f"```bash\n{SETUP_LINES[0]}\n{SETUP_LINES[1]}\n```\n" in text
    test_command = SETUP_LINES[1].split("#")[0].strip()
    ci_run = (ROOT / ".ci" / "run").read_text()
    runs = re.search(rf"^[^#\n]*(?<![\w/.-]){re.escape(test_command)}(?![\w/.-])", ci_run, re.M)
    assert runs, f".ci/run no longer runs the README's test command {test_command!r}"


def test_every_page_is_in_the_nav_once() -> None:
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(NAV) == pages
    assert len(NAV) == len(set(NAV))


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_has_a_page_and_a_readme_example(verb: str) -> None:
    assert f"verbs/{verb}.md" in NAV
    assert f"**`{verb}`**" in README.read_text(), f"the README shows no example of {verb}"


def test_readme_links_into_docs_resolve() -> None:
    links = [link for link in _LINK.findall(README.read_text()) if "://" not in link]
    assert len(links) >= len(VERBS)
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {link}, which does not exist"
        assert not anchor or anchor in _anchors(target), f"README.md links to {link}: no such heading"


def test_slug_matches_markdown() -> None:
    assert _slug("Errors and exit codes") == "errors-and-exit-codes"
    assert (
        _slug("Existing job scripts: audit and replace them") == "existing-job-scripts-audit-and-replace-them"
    )
    assert _slug("JSON reports (schema 1)") == "json-reports-schema-1"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the dev extra installs it)"
)
def test_site_builds_in_strict_mode(tmp_path: Path) -> None:
    config = ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", *config],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout
    assert "WARNING" not in done.stdout, done.stdout
    assert (tmp_path / "site" / "verbs" / "check" / "index.html").is_file()
    from verl_safe_launch.data.rulebook import rule_book

    for row in rule_book().rules:  # the address SARIF's helpUri and `explain` give each rule exists
        page = tmp_path / "site" / "rules" / row.group / "index.html"
        assert f'id="{row.id}"' in page.read_text(), f"{row.url}: no such anchor in the built site"

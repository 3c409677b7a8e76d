"""The rule table: every rule id the code can report has a row (and every row a rule), every example triggers
its rule through the real CLI, and docs/rules/ is what the table generates."""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.data.rulebook import DOCS_URL_ENV, SEVERITIES, docs_url, project_docs_url, rule_book
from verl_safe_launch.preflight import rule_catalog
from verl_safe_launch.render import rule_pages

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "verl_safe_launch"
RULE_ID = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)+$")
NOT_RULES = frozenset(
    {
        # hyphenated strings of the package that are no rule ids: verdicts, statuses, names, modes
        "dashboard-host", "dist-packages", "dry-run", "env-default", "hydra-core", "hydra-option", "input-error",
        "kv-cache", "memory-pid", "no-go", "no-gpu", "num-cpus", "num-gpus", "nvidia-smi", "preflight-failed",
        "ray-head", "ray-task", "ray-worker", "seq-mean-token-mean", "seq-mean-token-sum",
        "seq-mean-token-sum-norm", "site-packages", "token-mean", "token-sum", "utf-8", "verl-safe-launch",
        "vsl-config", "wait-ray", "wake-up", "deprecated-config", "kv-replicas", "kv-split", "yaml-values",
        "config-missing", "config-path", "optional-dependencies",
    }
)  # fmt: skip
Cli = Callable[..., CliResult]


def _literals() -> set[str]:
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and RULE_ID.match(node.value):
                found.add(node.value)
    return found


def test_every_rule_id_in_the_code_has_a_row_and_every_row_a_rule() -> None:
    """Every rule-id-shaped string of the package is a row of the table or a known non-rule, and back."""
    table = {row.id for row in rule_book().rules}
    from verl_safe_launch.inputs.verl_checks import PROBES

    literals = _literals() - set(PROBES)  # the names of verl's own checks a rule needs (``code:NAME``)
    assert sorted(literals - NOT_RULES - table) == [], "rule ids the code reports with no row in rules.yaml"
    assert sorted(table - literals) == [], "rows of rules.yaml no code reports"
    assert not NOT_RULES & table


def test_rows_are_complete() -> None:
    book = rule_book()
    assert len({row.id for row in book.rules}) == len(book.rules)
    for row in book.rules:
        assert row.group in book.groups and row.severity in SEVERITIES and set(row.also) <= set(SEVERITIES)
        assert row.checks and row.fix, row.id
        assert (row.example is not None) + (row.replayed_by is not None) + (row.unreachable is not None) == 1
        if row.replayed_by:
            assert row.id in (ROOT / row.replayed_by).read_text(), f"{row.replayed_by} never reaches {row.id}"


def test_docs_url_is_the_packages_documentation_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """One address for the docs: pyproject's Documentation URL (as installed), mkdocs' site_url by default,
    every rule's URL under it; VSL_DOCS_URL moves all of them."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Documentation"]
    monkeypatch.delenv(DOCS_URL_ENV, raising=False)
    assert project_docs_url() == declared and docs_url() == declared
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert f'site_url: !ENV [{DOCS_URL_ENV}, "{declared}"]\n' in mkdocs
    row = rule_book().by_id["layout-rollout-world"]
    assert row.url == f"{declared}rules/layout/#layout-rollout-world"
    monkeypatch.setenv(DOCS_URL_ENV, "https://docs.example.org/vsl")
    assert row.url == "https://docs.example.org/vsl/rules/layout/#layout-rollout-world"


def test_live_rules_agree_with_their_rows() -> None:
    """A rule's check declares what it needs of verl; the catalog shows it, and a ``since:`` need is its since."""
    for row in rule_catalog():
        for need in row.needs:
            if need.startswith("since:"):
                assert row.since == need.removeprefix("since:")


EXAMPLES = [row for row in rule_book().rules if row.example is not None]


@pytest.mark.parametrize("row", EXAMPLES, ids=[row.id for row in EXAMPLES])
def test_example_triggers_its_rule(row, cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The example of each row, run as the docs show it: the rule fires with one of its severities."""
    example = row.example
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")
    for name, text in example.files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if example.script is not None:
        body = "#!/bin/bash\n" + example.script
        (tmp_path / "run.sh").write_bytes((body.replace("\n", "\r\n") if example.crlf else body).encode())
    argv = example.argv("run.sh")
    result = cli(argv[0], "--format", "json", *argv[1:])
    document = json.loads(result.out)
    if "scripts" in document:
        findings = [f for s in document["scripts"] for launch in s["launches"] for f in launch["findings"]]
    else:
        findings = document["findings"]
    severities = {f["severity"] for f in findings if f["rule_id"] == row.id}
    assert severities & {row.severity, *row.also}, (row.id, sorted({f["rule_id"] for f in findings}))


def test_docs_rules_are_generated_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/rules/ equals what the table generates (VSL_UPDATE_GOLDEN=1 rewrites it)."""
    monkeypatch.delenv(DOCS_URL_ENV, raising=False)
    pages = rule_pages(rule_catalog(), rule_book())
    folder = ROOT / "docs" / "rules"
    if os.environ.get("VSL_UPDATE_GOLDEN") == "1":
        folder.mkdir(exist_ok=True)
        for name, text in pages.items():
            (folder / name).write_text(text)
    assert sorted(p.name for p in folder.glob("*.md")) == sorted(pages)
    for name, text in pages.items():
        assert (folder / name).read_text() == text, (
            f"docs/rules/{name} is stale: VSL_UPDATE_GOLDEN=1 rewrites it"
        )
    for row in rule_book().rules:
        assert f"## {row.id}\n" in pages[f"{row.group}.md"]


def test_rules_and_explain_rule(cli: Cli) -> None:
    listed = cli("rules")
    assert listed.code == 0 and f"{len(rule_book().rules)} rules;" in listed.out
    data = json.loads(cli("rules", "--format", "json").out)
    ids = [rule["id"] for rule in data["rules"]]
    assert ids == [row.id for row in rule_book().rules]
    first = data["rules"][0]
    assert set(first) >= {"id", "severity", "checks", "since", "fix", "url", "example"}
    entry = cli("explain", "layout-rollout-world")
    assert entry.code == 0 and entry.out.startswith("layout-rollout-world (error)\n  checks: rollout tensor")
    assert "rules/layout/#layout-rollout-world" in entry.out
    unknown = cli("explain", "layout-rollout-wrld")
    assert unknown.code == 2 and "did you mean layout-rollout-world" in unknown.err
    assert cli("explain", "data.train_batch_size=64", "actor_rollout_ref.rollout.name=vllm").code == 0


def test_launch_time_rules_reach_their_ids() -> None:
    """The cluster rules judge the nodes a live Ray reports (no command reaches them without a cluster): fed
    nodes as ``ray.nodes()`` describes them, each reports under its own id."""
    from verl_safe_launch.launch import NodeInfo, NodeNeed, node_findings

    def node(name: str, gpus: float, cpus: float, kind: str = "A100") -> NodeInfo:
        return NodeInfo(f"{name}-id-0000", name, True, gpus, cpus, 512.0, kind)

    need = NodeNeed(nodes=2, gpus_per_node=8, cpus_per_node=24, extra_cpus=10)

    def ids(nodes: list[NodeInfo]) -> set[str]:
        return {f.rule_id for f in node_findings(nodes, need, "test cluster")}

    assert "cluster-node-short" in ids([node("a", 8, 40), node("b", 4, 40)])
    assert "cluster-node-cpus" in ids([node("a", 8, 24), node("b", 8, 24)])
    assert "cluster-heterogeneous" in ids([node("a", 8, 40), node("b", 8, 40, "H100")])

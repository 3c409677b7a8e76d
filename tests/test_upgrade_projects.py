"""Real projects on older verl (tests/data/upgrade_projects/, each with its SOURCE.json: repository, commit, the
upstream release its vendored verl is closest to): upgraded in their checkout, every line of the report judged
against the project's own vendored verl and against verl 0.9.1 and its engines (see tests/upgrade_projects.py).

bench/upgrade_projects.py runs every script; the tests here run a few of each project.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult, make_tiny_model
from upgrade_projects import PROJECTS, CorpusScript, corpus_scripts, judge, within_one

from verl_safe_launch.audit import Detection, closest_release, copy_defaults, detect, evidence_of
from verl_safe_launch.inputs import read_version
from verl_safe_launch.shell import read_script

SCRIPTS = corpus_scripts()
PER_PROJECT = 2
"""Scripts judged per project here (spread over the project's sorted list); the bench judges all."""


def _sample() -> list[CorpusScript]:
    out: list[CorpusScript] = []
    for project in sorted({s.project for s in SCRIPTS}):
        mine = [s for s in SCRIPTS if s.project == project]
        step = max(1, len(mine) // PER_PROJECT)
        out += mine[::step][:PER_PROJECT]
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local stand-in for the launches' models (verl's validate_config reads the critic's config)."""
    return make_tiny_model(tmp_path_factory.mktemp("model"), num_attention_heads=32, num_key_value_heads=8)


@pytest.mark.slow  # verl's validate_config judges every advice line
@pytest.mark.parametrize("script", _sample(), ids=lambda s: s.name)
def test_every_line_of_the_upgrade_is_what_verl_and_the_old_run_say(
    script: CorpusScript, model: Path, tmp_path: Path
) -> None:
    judged = judge(script, tmp_path / "out", model)
    assert judged.exit_code == 0, judged.error
    assert judged.data["source_release"] == script.truth
    assert judged.rejected == []
    assert judged.noop == []
    assert judged.unlisted == []
    assert judged.unreported == []


def test_the_corpus_cites_where_each_file_came_from() -> None:
    """Every file under a project is a script or vendored file its SOURCE.json names, at a commit."""
    for source_file in sorted(PROJECTS.glob("*/SOURCE.json")):
        source = json.loads(source_file.read_text())
        assert len(source["commit"]) == 40 and "/" in source["repo"] and source["license"]
        named = {e["path"] for e in source["scripts"]} | set(source["vendored"])
        present = {
            str(p.relative_to(source_file.parent)) for p in source_file.parent.rglob("*") if p.is_file()
        }
        assert present - {"SOURCE.json"} == named, source_file


@pytest.mark.parametrize("project", sorted({s.project for s in SCRIPTS}))
def test_a_copy_gives_the_release_it_is_closest_to(project: str) -> None:
    """The release read from a project's vendored copy (its defaults against the shipped history) is the one the
    corpus found by matching the copy against upstream verl's git history, within one minor release."""
    script = next(s for s in SCRIPTS if s.project == project)
    defaults, _, _ = copy_defaults(script.package)
    series, _ = closest_release(defaults, read_version(script.package))
    assert within_one(series, script.truth), (series, script.truth)


def _lone_path(path: Path, installed: dict[str, object]) -> Detection:
    """What detection reads from a script with nothing beside it: its overrides and what it exports."""
    launch = read_script(path)[0]
    exports = [(e.name, e.value) for e in launch.exports]
    return detect(evidence_of([t.text for t in launch.tokens], frozenset(), exports), installed)


def _lone(script: CorpusScript, installed: dict[str, object]) -> Detection:
    return _lone_path(script.path, installed)


@pytest.fixture(scope="module")
def installed() -> dict[str, object]:
    from verl_safe_launch.audit import installed_defaults

    return installed_defaults()


def test_a_lone_script_is_detected_within_one_release_or_asked_with_the_right_release_offered(
    installed: dict[str, object],
) -> None:
    """Without its project's verl, a script is never upgraded from a wrong release: it is detected within one
    minor release of the truth, or refused with ``--from`` choices that include the truth; at least 85% are
    detected."""
    detected = asked = 0
    for script in SCRIPTS:
        found = _lone(script, installed)
        if found.weak:
            asked += 1
            assert script.truth in found.asked(), (script.name, found.why, found.asked())
        else:
            detected += 1
            assert within_one(found.series, script.truth), (script.name, found.why)
    assert detected >= 0.85 * len(SCRIPTS), (detected, asked)


LATER_FORK = Path(__file__).parent / "data" / "lone_scripts" / "verl-tool"


def test_a_later_forks_lone_scripts_are_detected_within_one_release_or_asked(
    installed: dict[str, object], tmp_path: Path
) -> None:
    """Scripts the detection rules were not made on: verl-tool's own launches that compose and validate on its
    vendored verl, which matches upstream verl closest to 0.6.0 (SOURCE.json). Their keys are mostly keys verl 0.4
    already had, so taking the oldest release that fits read them as 0.4. Each is now detected within one release
    of 0.6 or refused with 0.6 offered, and most are detected. They launch ``verl_tool.trainer.main_ppo``, which
    composes verl's ppo_trainer with verl-tool's own keys; the copy read here names verl's main instead."""
    source = json.loads((LATER_FORK / "SOURCE.json").read_text())
    truth = ".".join(source["verl"]["closest_release"].split(".")[:2])
    detected = asked = 0
    for name in source["scripts"]:
        text = (LATER_FORK / name).read_text()
        assert "verl_tool.trainer.main_ppo" in text, name
        lone = tmp_path / name.replace("/", "_")
        lone.write_text(text.replace("verl_tool.trainer.main_ppo", "verl.trainer.main_ppo"))
        found = _lone_path(lone, installed)
        if found.weak:
            asked += 1
            assert truth in found.asked(), (name, found.why)
        else:
            detected += 1
            assert within_one(found.series, truth), (name, found.why)
    assert detected >= 0.75 * len(source["scripts"]), (detected, asked)


def _without_era(path: Path, tmp_path: Path) -> Path:
    """The script with its ``export VLLM_ATTENTION_BACKEND=...`` line taken out."""
    out = tmp_path / path.name
    out.write_text(
        "".join(line for line in path.read_text().splitlines(True) if "VLLM_ATTENTION_BACKEND" not in line)
    )
    return out


def test_keys_a_project_copied_from_a_later_verl_do_not_date_its_launch(
    installed: dict[str, object], tmp_path: Path
) -> None:
    """verl-agent's DAPO launch sets algorithm.filter_groups.*, which upstream verl has only from 0.9: they are
    named as fork keys, and 0.9 is not among the releases that fit. Its VLLM_ATTENTION_BACKEND=XFORMERS then
    dates it to 0.4 or older."""
    script = next(s for s in SCRIPTS if s.name == "verl-agent/examples/dapo_trainer/run_alfworld.sh")
    found = _lone(script, installed)
    assert found.oldest == "0.4" and "0.9" not in found.asked()
    assert "algorithm.filter_groups.enable" in found.fork_keys
    assert found.series == "0.4" and not found.weak and "XFORMERS dates it to verl 0.4" in found.why
    without = _lone_path(_without_era(script.path, tmp_path), installed)
    assert without.weak and without.oldest == "0.4" and "0.9" not in without.asked(), without.why


@pytest.mark.slow  # upgrade judges its advice with verl's validate_config
def test_a_forks_default_estimator_survives_the_upgrade_and_check_flags_it_without_a_group(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """DeepResearcher made GRPO its verl's default; train_grpo.sh never names the estimator and sets its group
    size with its own agent_grpo.n. The upgrade keeps GRPO, and check then warns of one response per prompt
    (verl runs it with no baseline; --strict refuses it)."""
    script = PROJECTS / "DeepResearcher" / "train_grpo.sh"
    result = cli("upgrade", str(script), "-o", str(tmp_path), "--format", "json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    kept = [c for c in data["changes"] if c["kind"] == "kept" and c["key"] == "algorithm.adv_estimator"]
    assert len(kept) == 1 and "grpo" in kept[0]["detail"] and "ppo_trainer.yaml:157" in kept[0]["detail"]
    check = cli("check", "-c", str(tmp_path / "train_grpo.yaml"), "--format", "json")
    rules = {f["rule_id"] for f in json.loads(check.out)["findings"] if f["severity"] == "warning"}
    assert check.code == 0 and "verl-group-estimator-n" in rules
    strict = cli("check", "-c", str(tmp_path / "train_grpo.yaml"), "--strict")
    assert strict.code == 1 and "verl-group-estimator-n" in strict.out


@pytest.mark.slow  # upgrade judges its advice with verl's validate_config
def test_a_pin_in_the_project_gives_the_release_its_keys_leave_open(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """verl-agent's gigpo run_search.sh alone fits verl 0.4 to 0.9 alike (and exports no setting of an engine's era),
    and upgrade asks for --from; in a project whose pyproject.toml pins verl==0.4.1 (and that vendors no copy), the
    pin gives the release."""
    script = PROJECTS / "verl-agent" / "examples" / "gigpo_trainer" / "run_search.sh"
    project = tmp_path / "project"
    project.mkdir()
    (project / script.name).write_text(script.read_text())
    asked = cli("upgrade", str(project / script.name), "-o", str(tmp_path / "asked"), "--format", "json")
    assert asked.code == 2 and "--from" in asked.err, asked.err
    (project / "pyproject.toml").write_text('[project]\nname = "agent"\ndependencies = ["verl==0.4.1"]\n')
    result = cli("upgrade", str(project / script.name), "-o", str(tmp_path / "out"), "--format", "json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["source_release"] == "0.4"
    assert "pins verl==0.4.1" in json.dumps(data)


@pytest.mark.slow  # upgrade judges its advice with verl's validate_config
def test_a_script_read_within_a_range_lists_what_each_release_of_it_would_change(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """verl-tool's search_r1 train_3b.sh alone fits verl 0.4 to 0.6 and is read as 0.5. Whatever release of the
    three it ran on, every behaviour change that release's own upgrade (``--from``) lists is in the report: as a
    ``default`` line, or as a ``range`` line naming that release."""
    name = "examples/train/search_r1/train_3b.sh"
    script = tmp_path / "train_3b.sh"
    script.write_text(
        (LATER_FORK / name).read_text().replace("verl_tool.trainer.main_ppo", "verl.trainer.main_ppo")
    )

    def changes(*extra: str) -> list[dict[str, Any]]:
        result = cli(
            "upgrade", str(script), "-o", str(tmp_path / "out"), "--force", "--format", "json", *extra
        )
        assert result.code == 0, result.err
        data = json.loads(result.out)
        return [c for c in data["changes"] if c["kind"] in ("default", "range")]

    lone = changes()
    assert {c["kind"] for c in lone} == {"default", "range"}
    for release in ("0.4", "0.5", "0.6"):
        wanted = {c["key"] for c in changes("--from", release) if c["kind"] == "default"}
        listed = {c["key"] for c in lone if c["kind"] == "default" or f"verl {release} too" in c["detail"]}
        assert wanted and wanted <= listed, (release, wanted - listed)

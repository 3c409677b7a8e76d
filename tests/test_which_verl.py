"""Which verl a project uses: --verl, a vendored copy beside or above the script, the project's pin, the installed.

The copies are real: the installed verl package, linked into a temporary project as its vendored ``verl/``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import CliResult

from verl_safe_launch.inputs import OFFLINE_ENV, choose_verl, fetch_command, project_verl
from verl_safe_launch.inputs.knowledge import read_version
from verl_safe_launch.inputs.pins import pins_in, project_pin
from verl_safe_launch.inputs.verl_paths import installed_verl

INSTALLED, _ = installed_verl()
RELEASE = read_version(INSTALLED)
LAUNCH = "python3 -m verl.trainer.main_ppo trainer.n_gpus_per_node=8 data.train_batch_size=64\n"


@pytest.fixture(autouse=True)
def _forget_choices() -> Iterator[None]:
    yield
    choose_verl(None, scope="project")
    choose_verl(None)


def _vendor(directory: Path) -> Path:
    """A project directory vendoring a real verl (the installed package, linked)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "verl").symlink_to(INSTALLED, target_is_directory=True)
    return directory


def _script(path: Path, text: str = LAUNCH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_copy_vendored_beside_the_script_is_used(tmp_path: Path) -> None:
    script = _script(_vendor(tmp_path / "proj") / "run.sh")
    choice = project_verl(script)
    assert choice.path == INSTALLED.resolve()
    assert (choice.release, choice.how, choice.tested) == (RELEASE, "vendored beside run.sh", True)


def test_a_copy_vendored_above_the_script_is_used_up_to_the_project_root(tmp_path: Path) -> None:
    project = _vendor(tmp_path / "proj")
    script = _script(project / "examples" / "grpo" / "run.sh")
    assert project_verl(script).how == "vendored 2 directories above run.sh"
    (project / "examples" / "pyproject.toml").write_text("[project]\nname = 'x'\n")  # a project root below it
    assert project_verl(script).how == "installed"


def test_verl_given_on_the_command_line_wins_over_the_vendored_copy(tmp_path: Path) -> None:
    script = _script(_vendor(tmp_path / "proj") / "run.sh")
    choose_verl(INSTALLED.parent, "--verl")
    assert project_verl(script).how == "--verl"


def test_a_script_that_cds_into_a_vendoring_project_reads_that_verl(tmp_path: Path) -> None:
    project = _vendor(tmp_path / "project")
    script = _script(tmp_path / "scripts" / "run.sh", "set -x\ncd ../project  # the repo root\n" + LAUNCH)
    choice = project_verl(script)
    assert choice.how == "vendored in ../project, where run.sh cd's"
    assert choice.path == (project / "verl").resolve()
    script.write_text('cd "$ROOT"\n' + LAUNCH)
    assert project_verl(script).how == "installed"
    exported = project_verl(script, [("PYTHONPATH", "../project:$PYTHONPATH")])
    assert exported.how == "PYTHONPATH set by run.sh"


@pytest.mark.parametrize(
    ("why", "make"),
    [
        ("it has no trainer/config/ppo_trainer.yaml", lambda v: (v / "__init__.py").write_text("")),
        ("it has no __init__.py", lambda v: (v / "trainer" / "config").mkdir(parents=True)),
    ],
)
def test_a_vendored_copy_that_cannot_be_read_is_named_and_the_installed_verl_used(
    tmp_path: Path, why: str, make: Callable[[Path], object], cli: Callable[..., CliResult]
) -> None:
    (tmp_path / "proj" / "verl").mkdir(parents=True)
    make(tmp_path / "proj" / "verl")
    script = _script(tmp_path / "proj" / "run.sh")
    choice = project_verl(script)
    assert choice.how == "installed"
    assert choice.warning == (
        f"the verl vendored at {tmp_path / 'proj' / 'verl'} cannot be read ({why}), so it is not used"
    )
    result = cli("audit", str(script))
    lines = result.out.splitlines()
    assert lines[0] == f"verl {RELEASE} at site-packages/verl (installed), a tested release"
    assert lines[1] == f"warning: {choice.warning}"
    assert "Traceback" not in result.err and result.code in (0, 1)
    data = json.loads(cli("audit", str(script), "--format", "json").out)
    assert data["verl"]["warning"] == choice.warning


def test_a_vendored_copy_behind_a_permission_error_is_named(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file: a permission error cannot be made here")
    package = tmp_path / "proj" / "verl"
    (package / "trainer" / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    config = package / "trainer" / "config" / "ppo_trainer.yaml"
    config.write_text("data: {}\n")
    config.chmod(0)
    try:
        choice = project_verl(_script(tmp_path / "proj" / "run.sh"))
    finally:
        config.chmod(0o644)
    assert choice.how == "installed" and choice.warning is not None and "Permission denied" in choice.warning


PIN_FILES = [
    ("requirements.txt", "torch==2.4.0\nverl[vllm]==0.5.0  # the release we ran\n", 2),
    ("requirements-train.txt", "-r base.txt\nverl===0.5.0\n", 2),
    ("pyproject.toml", '[project]\nname = "p"\ndependencies = ["ray", "verl==0.5.0"]\n', 3),
    ("pyproject.toml", '[tool.poetry.dependencies]\npython = "^3.10"\nverl = "0.5.0"\n', 3),
    ("setup.py", 'from setuptools import setup\nsetup(install_requires=[\n    "verl==0.5.0",\n])\n', 3),
    ("setup.cfg", "[options]\ninstall_requires =\n    ray\n    verl==0.5.0\n", 4),
]


@pytest.mark.parametrize(
    ("name", "text", "line"), PIN_FILES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(PIN_FILES)]
)
def test_exact_pins_are_read_from_every_kind_of_dependency_file(
    tmp_path: Path, name: str, text: str, line: int
) -> None:
    (tmp_path / name).write_text(text)
    [pin] = pins_in(tmp_path / name)
    assert (pin.version, pin.where) == ("0.5.0", f"{name}:{line}")


@pytest.mark.parametrize("spec", ["verl>=0.5", "verl~=0.5.0", "verl==0.5.*", "verl", "verl-tools==1.0"])
def test_a_range_or_another_package_is_not_a_pin(tmp_path: Path, spec: str) -> None:
    (tmp_path / "requirements.txt").write_text(spec + "\n")
    assert project_pin([tmp_path]) is None


def test_a_pin_of_the_installed_release_is_the_installed_verl(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text(f"verl=={RELEASE}\n")
    choice = project_verl(_script(tmp_path / "run.sh"))
    assert (choice.path, choice.how) == (INSTALLED, "installed, the release requirements.txt:1 pins")


def test_a_pinned_release_in_the_cache_is_read_from_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., CliResult]
) -> None:
    """The cache's copy of a pinned release is used as is (here: the installed package, filed as 0.5.0)."""
    monkeypatch.setenv("VSL_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "cache" / "releases" / "0.5.0"
    copy.mkdir(parents=True)
    (copy / "verl").symlink_to(INSTALLED, target_is_directory=True)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "requirements.txt").write_text("verl==0.5.0\n")
    script = _script(tmp_path / "proj" / "run.sh")
    choice = project_verl(script)
    assert (choice.path, choice.how) == (
        (copy / "verl").resolve(),
        "verl==0.5.0 pinned in requirements.txt:1, a pip --target copy",
    )


def test_a_pinned_release_not_fetched_names_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., CliResult]
) -> None:
    monkeypatch.setenv("VSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(OFFLINE_ENV, "1")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "requirements.txt").write_text("verl==0.5.0\n")
    script = _script(tmp_path / "proj" / "run.sh")
    command = fetch_command("0.5.0")
    assert (
        command == f"pip install --no-deps --target {tmp_path / 'cache' / 'releases' / '0.5.0'} verl==0.5.0"
    )
    result = cli("audit", str(script))
    assert result.out.splitlines()[1] == (
        "warning: requirements.txt:1 pins verl==0.5.0, which is not installed here and was not fetched "
        f"({OFFLINE_ENV}=1); to check against it: {command}"
    )
    assert not (tmp_path / "cache" / "releases").exists()


def test_check_reads_the_verl_of_the_project_it_runs_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., CliResult]
) -> None:
    project = _vendor(tmp_path / "proj")
    (project / "conf").mkdir()
    (project / "conf" / "run.yaml").write_text("trainer:\n  n_gpus_per_node: 8\n")
    shown = f"verl {RELEASE} at {INSTALLED.resolve()}"
    result = cli("check", "-c", str(project / "conf" / "run.yaml"), "--format", "json")
    assert json.loads(result.out)["verl"]["origin"] == "vendored 1 directory above run.yaml"
    monkeypatch.chdir(project)
    result = cli("check", "data.train_batch_size=64")
    assert result.out.splitlines()[0] == f"{shown} (vendored in the working directory), a tested release"


@pytest.mark.parametrize("holder", ["verl", "src"])
def test_a_verl_checkout_the_project_installs_from_is_its_verl(tmp_path: Path, holder: str) -> None:
    """``proj/verl/verl`` (a checkout of verl's repository) or ``proj/src/verl``, installed from there."""
    project = tmp_path / "proj"
    (project / holder).mkdir(parents=True)
    (project / holder / "verl").symlink_to(INSTALLED, target_is_directory=True)
    script = _script(project / "scripts" / "train" / "run.sh")
    choice = project_verl(script)
    assert (choice.path, choice.how) == (INSTALLED.resolve(), "vendored 2 directories above run.sh")

"""The custom reward file verl imports: our static reading against verl's own load_extern_object."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_safe_launch.compose import compose
from verl_safe_launch.context import HardwareFacts, RuleContext
from verl_safe_launch.findings import Severity
from verl_safe_launch.inputs import ComposeRequest, cli_tokens
from verl_safe_launch.preflight import rule_context
from verl_safe_launch.rules import run_rules

SOURCES = {
    "plain.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    "guarded.py": "try:\n    import math\nexcept ImportError:\n    math = None\nif math:\n    def compute_score(*a):\n        return 0.0\n",
    "assigned.py": "def _impl(*a):\n    return 0.0\ncompute_score = _impl\n",
    "other_name.py": "def my_reward(*a):\n    return 0.0\n",
    "broken.py": "def compute_score(:\n    pass\n",
    "star.py": "from math import *\n",
}


def findings(path: str, name: str = "compute_score", here: bool = True) -> list[object]:
    tokens = cli_tokens(
        [f"reward.custom_reward_function.path={path}", f"reward.custom_reward_function.name={name}"]
    )
    ctx = rule_context(compose(ComposeRequest(overrides=tokens)))
    hardware = HardwareFacts(gpus_per_node=8, on_this_machine=here)
    ctx = RuleContext(ctx.view, ctx.actor_arch, ctx.critic_arch, hardware)
    return [f for f in run_rules(ctx) if f.rule_id == "reward-code-missing"]


def verl_loads(path: str, name: str) -> bool:
    from verl.utils.import_utils import load_extern_object

    try:
        load_extern_object(module_path=path, object_name=name)
    except (FileNotFoundError, RuntimeError, AttributeError, ImportError):
        return False
    return True


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("plain.py", "compute_score"),
        ("guarded.py", "compute_score"),
        ("assigned.py", "compute_score"),
        ("other_name.py", "compute_score"),
        ("broken.py", "compute_score"),
        ("missing.py", "compute_score"),
        ("star.py", "pi"),
        ("star.py", "no_such_name"),
    ],
)
def test_an_error_exactly_where_verl_cannot_load_it(tmp_path: Path, file: str, name: str) -> None:
    for written, text in SOURCES.items():
        (tmp_path / written).write_text(text)
    path = str(tmp_path / file)
    found = findings(path, name)
    loads = verl_loads(path, name)
    if file == "star.py":  # a star import binds names the reader does not follow: never refused
        assert found == []
        return
    assert (found == []) == loads, (found, loads)
    assert all(f.severity is Severity.ERROR for f in found)


def test_off_the_machine_that_runs_it_the_file_is_a_warning(tmp_path: Path) -> None:
    (found,) = findings(str(tmp_path / "missing.py"), here=False)
    assert found.severity is Severity.WARNING and "cannot verify where the job runs" in found.message


def test_a_registered_reward_manager_leaves_the_module_path_unread(tmp_path: Path) -> None:
    tokens = cli_tokens([f"reward.reward_manager.module.path={tmp_path / 'nope.py'}"])
    ctx = rule_context(compose(ComposeRequest(overrides=tokens)))
    assert [f for f in run_rules(ctx) if f.rule_id == "reward-code-missing"] == []

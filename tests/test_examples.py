"""Every bundled example runs through the pre-flight, and the README's main job runs as written."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT, CliResult

# Extra arguments each example needs (an example written for a preset names it here).
EXAMPLE_ARGS: dict[str, list[str]] = {
    "grpo_6gpu.yaml": [],
    "grpo_preset.yaml": [
        "preset=auto",
        "hardware.nodes=1",
        "hardware.gpus_per_node=6",
        "hardware.gpu_memory_gb=80",
    ],
}


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXAMPLE_ARGS)


@pytest.mark.parametrize("name", sorted(EXAMPLE_ARGS))
def test_example_passes_check(cli: Callable[..., CliResult], name: str) -> None:
    result = cli("check", "-c", str(EXAMPLES / name), *EXAMPLE_ARGS[name])
    assert result.code == 0, result.out + result.err
    assert "GO: 0 errors" in result.out


def _readme_main_job() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        r"^bash \.ci/setup-venv && \.venv/bin/verl-safe-launch (.*?)\s+# the main job", readme, re.M
    )
    assert match, "the README's main-job command line is missing"
    return match.group(1).split()


def test_readme_after_line_is_go_as_written(
    cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")  # the declared machine only, not this one's CPUs
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        r"^The same run with verl-safe-launch.*?\n```bash\n\.venv/bin/verl-safe-launch (.*?)\n```",
        readme,
        re.M | re.S,
    )
    assert match, "the README's 'after' command line is missing"
    args = [a.replace("launch_examples/", f"{EXAMPLES}/") for a in match.group(1).split()]
    result = cli("check", *args)
    assert result.code == 0, result.out + result.err
    assert "GO: 0 errors, 0 warnings" in result.out


@pytest.mark.slow
def test_readme_main_job_runs_the_whole_pipeline(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    """No GPU here: the main job ends with the dry-run plan and exit 0 (the launch itself needs GPUs)."""
    args = [a.replace("launch_examples/", f"{EXAMPLES}/") for a in _readme_main_job()]
    result = cli(*args, "--run-dir", str(tmp_path / "run"))
    assert result.code == 0, result.out + result.err
    assert "preset=auto chose medium" in result.out
    assert "adapted trainer.n_gpus_per_node from 8 to 6" in result.out
    assert "No GPU on this machine: the pre-flight passed and nothing was started." in result.out
    assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.parametrize("cp", ["", "2"])
def test_the_readme_branch_example_is_refused_by_verl_in_every_world(tmp_path: Path, cp: str) -> None:
    """launch_examples/megatron_cp.sh: real bash (the trace) with and without $CP, then verl's own
    validate_config on what bash passed, refuse it; the static audit, which never ran bash, says NO-GO."""
    from conftest import make_tiny_model
    from verl_oracle import verl_verdict

    from verl_safe_launch.compose import compose
    from verl_safe_launch.inputs import OverrideToken
    from verl_safe_launch.preflight import Auditor
    from verl_safe_launch.provenance import Layer, Source
    from verl_safe_launch.shell import read_script, trace_script, traced_launches

    script = EXAMPLES / "megatron_cp.sh"
    (launch,) = traced_launches(
        str(script), trace_script(script, {"CP": cp} if cp else {}).calls, read_script(script)
    )
    assert any("context_parallel_size=2" in t.text for t in launch.tokens) == bool(cp)
    model = OverrideToken(
        f"actor_rollout_ref.model.path={make_tiny_model(tmp_path / 'm')}", Source(Layer.CLI)
    )
    request = launch.request(lenient=True)
    composed = compose(replace(request, overrides=(*request.overrides, model)))
    assert composed.rejected == ()
    refusal = verl_verdict(composed.cfg)
    assert refusal is not None and "log_prob_micro_batch_size" in refusal
    (audited,) = Auditor().script(script).launches
    assert audited.verdict == "no-go"
    assert [f.rule_id for f in audited.findings if f.severity.value == "error"] == [
        "verl-ref-logprob-micro-keys"
    ]

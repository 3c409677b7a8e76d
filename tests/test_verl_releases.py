"""Each verl release from 0.5.0 on, beside the installed one: composition, the example's verdict, registries.

The releases are installed with ``pip install --no-deps --target`` into a directory the tests own
(``$VSL_TEST_VERL_RELEASES``, else the pytest cache), once; they need network access to PyPI the first time.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from conftest import VERL_RELEASES as RELEASES
from conftest import CliResult, make_tiny_model
from omegaconf import OmegaConf

from verl_safe_launch.compose import compose
from verl_safe_launch.inputs import ComposeRequest, choose_verl, cli_tokens, read_registries, verl_release
from verl_safe_launch.inputs.schema import load_schema
from verl_safe_launch.inputs.schema_ast import SourceReader, read_schema
from verl_safe_launch.inputs.schema_shape import targets_of

NO_ENTRY_POINT = {"0.6.1": "its main_ppo imports transformers.AutoModelForVision2Seq, gone from this venv"}
"""Releases whose ``main_ppo --cfg job`` cannot run here: Hydra's compose of their config dir is the oracle."""
LINES = [
    "data.train_batch_size=60",
    "actor_rollout_ref.rollout.n=12",
    "trainer.n_gpus_per_node=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=60",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def chosen(releases: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """Make one release the verl every check reads, for one test."""
    target = releases / request.param
    choose_verl(target, "--verl")
    yield target
    choose_verl(None)


def _theirs(target: Path, version: str, lines: list[str], tmp_path: Path) -> dict[str, object]:
    """The release's own composition: ``main_ppo --cfg job``, or Hydra's compose where that cannot run."""
    if version in NO_ENTRY_POINT:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir

        with initialize_config_dir(str(target / "verl" / "trainer" / "config"), version_base=None):
            cfg = hydra_compose("ppo_trainer", overrides=lines)
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]
    env = {**os.environ, "PYTHONPATH": str(target)}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", *lines]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True)
    return yaml.safe_load(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("chosen", RELEASES, indirect=True)
def test_composition_equals_the_releases_own(chosen: Path, tmp_path: Path) -> None:
    ours = compose(ComposeRequest(overrides=cli_tokens(LINES)))
    mine = yaml.safe_load(OmegaConf.to_yaml(ours.cfg, resolve=False))
    assert verl_release().version == chosen.name
    assert mine == _theirs(chosen, chosen.name, LINES, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_example_is_go_under_each_release(releases: Path, version: str) -> None:
    """The bundled example runs on every release: no V1-only rule or 0.9-only fact may refuse it."""
    env = {**os.environ, "PYTHONPATH": f"{releases / version}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "verl_safe_launch", "check", "-c", "launch_examples/grpo_6gpu.yaml"]
    out = subprocess.run(
        [*cmd, "--format", "json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    data = json.loads(out.stdout)
    assert out.returncode == 0, [f["message"] for f in data["findings"] if f["severity"] == "error"]
    assert data["verl"]["version"] == version and data["verl"]["origin"] == "PYTHONPATH"
    messages = " ".join(f["message"] for f in data["findings"])
    assert "0.9.1" not in messages
    if version != "0.9.1":
        assert "verl-trainer-mode" in data["verl"]["not_judged"]["config:trainer.v1"]


REGISTRY_TABLES = {
    "advantage estimator": ("verl.trainer.ppo.core_algos", "ADV_ESTIMATOR_REGISTRY"),
    "policy loss": ("verl.trainer.ppo.core_algos", "POLICY_LOSS_REGISTRY"),
    "reward manager": ("verl.workers.reward_manager.registry", "REWARD_MANAGER_REGISTRY"),
}
PROBE = """
import importlib, json, sys
out = {}
for name, (module, table) in json.loads(sys.argv[1]).items():
    try:
        out[name] = sorted(getattr(importlib.import_module(module), table))
    except Exception as exc:
        out[name] = repr(exc)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_static_registries_hold_what_importing_the_release_registers(releases: Path, version: str) -> None:
    """verl's own registries, filled by importing the release, are all found by reading its source."""
    env = {**os.environ, "PYTHONPATH": str(releases / version)}
    cmd = [sys.executable, "-c", PROBE, json.dumps(REGISTRY_TABLES)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
    real = json.loads(out.stdout.strip().splitlines()[-1])
    static = read_registries(releases / version)
    imported = {name: names for name, names in real.items() if isinstance(names, list)}
    assert imported, f"no registry of verl {version} could be imported here: {real}"
    for name, names in imported.items():
        assert set(names) <= set(static[name]), name


SCHEMA_ORACLE = """
import json, sys
from pathlib import Path
import verl
from verl_safe_launch.inputs.schema import generate_schema
print(json.dumps(generate_schema(Path(verl.__file__).parent / "trainer" / "config")))
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_static_schema_equals_the_releases_dataclasses(releases: Path, version: str) -> None:
    """The schema read from a release's source is what importing its dataclasses says (where they import)."""
    package = releases / version / "verl"
    static = read_schema(package)
    assert static["verl_version"] == version
    reader = SourceReader(package)
    defined = {t for t in targets_of(package / "trainer" / "config") if reader.target(t) is not None}
    assert defined and defined <= set(static["classes"])
    env = {**os.environ, "PYTHONPATH": f"{releases / version}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-c", SCHEMA_ORACLE]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"verl {version}'s dataclasses cannot be imported here: {reason}")
    assert static == json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("chosen", ["0.8.0"], indirect=True)
def test_schema_and_field_checks_follow_the_chosen_release(
    chosen: Path, cli: Callable[..., CliResult]
) -> None:
    """0.9 added CheckpointConfig.save_lora_only and dropped FSDPEngineConfig.grad_offload: per release."""
    schema = load_schema()
    assert "save_lora_only" not in schema["verl.trainer.config.CheckpointConfig"]
    assert "grad_offload" in schema["verl.workers.config.FSDPEngineConfig"]

    def rules(line: str, *verl: str) -> list[tuple[str, str]]:
        result = cli("check", *verl, line, "--format", "json")
        leaf = line.rpartition(".")[2].partition("=")[0]
        found = json.loads(result.out)["findings"]
        return [(f["rule_id"], f["severity"]) for f in found if leaf in f["message"]]

    lora = "+actor_rollout_ref.actor.checkpoint.save_lora_only=true"
    offload = "+actor_rollout_ref.actor.fsdp_config.grad_offload=true"
    assert rules(lora, "--verl", str(chosen)) == [("new-key", "error")]
    assert rules(offload, "--verl", str(chosen)) == [("dataclass-field", "info")]
    choose_verl(None)
    assert "save_lora_only" in load_schema()["verl.trainer.config.CheckpointConfig"]
    assert rules(lora) == [("dataclass-field", "info")]
    assert rules(offload) == [("new-key", "error")]


@pytest.mark.slow
def test_audit_reads_the_verl_a_project_vendors(
    releases: Path, tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "verl").symlink_to(releases / "0.5.0" / "verl")
    script = project / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=gigpo trainer.n_gpus_per_node=8\n"
    )
    result = cli("audit", str(script))
    choose_verl(None, scope="project")
    assert result.out.startswith(
        f"verl 0.5.0 at {(releases / '0.5.0' / 'verl').resolve()} (vendored beside run.sh)"
    )
    assert "algorithm.adv_estimator=gigpo is not a registered advantage estimator in verl 0.5.0" in result.out


def test_knowledge_is_cached_under_xdg_cache_home(knowledge_cache: Path) -> None:
    """Derived facts land in ``$XDG_CACHE_HOME/verl-safe-launch``, keyed by release and fingerprint, and are read back."""
    from verl_safe_launch.inputs import knowledge_dir, registered_names, verl_cache

    choose_verl(None)
    names = registered_names()
    where = knowledge_dir()
    assert where.parent == knowledge_cache / "verl-safe-launch"
    assert where.name.startswith(f"verl-{verl_release().version}-")
    [facts] = where.glob("registries-*.json")  # named by a digest of the registry table
    cached = json.loads(facts.read_text())
    assert {k: frozenset(v) for k, v in cached.items()} == names
    facts.write_text(json.dumps({"policy loss": ["only-this"]}))
    choose_verl(None)  # forget what this process read: the next read comes from the file
    try:
        assert registered_names()["policy loss"] == frozenset({"only-this"})
    finally:
        facts.unlink()
        choose_verl(None)
    assert verl_cache is not None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "algorithm.adv_estimator=gigpo",
            "algorithm.adv_estimator=gigpo is not a registered advantage estimator in verl 0.9.1",
        ),
        (
            "reward.reward_manager.name=ttrl",
            "reward.reward_manager.name=ttrl is not a registered reward manager",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=gpso",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gpso is not a registered policy loss",
        ),
    ],
)
def test_unregistered_names_are_errors(cli: Callable[..., CliResult], line: str, message: str) -> None:
    result = cli("check", line, "--format", "json")
    found = [f for f in json.loads(result.out)["findings"] if f["rule_id"] == "verl-registry-name"]
    assert result.code == 1 and len(found) == 1
    assert found[0]["severity"] == "error" and found[0]["message"].startswith(message)


def test_registered_names_and_custom_sources_pass(cli: Callable[..., CliResult]) -> None:
    lines = [
        "algorithm.adv_estimator=rloo",
        "reward.reward_manager.name=mine",
        "reward.reward_manager.source=importlib",
    ]
    result = cli("check", *lines, "--format", "json")
    assert not [f for f in json.loads(result.out)["findings"] if f["rule_id"] == "verl-registry-name"]


def test_did_you_mean_fix_is_registered(cli: Callable[..., CliResult]) -> None:
    result = cli("check", "actor_rollout_ref.actor.policy_loss.loss_mode=gpso", "--format", "json")
    found = next(f for f in json.loads(result.out)["findings"] if f["rule_id"] == "verl-registry-name")
    assert found["fix"] == "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"
    again = cli("check", found["fix"], "--format", "json")
    assert not [f for f in json.loads(again.out)["findings"] if f["rule_id"] == "verl-registry-name"]


def test_cached_defaults_equal_a_fresh_composition() -> None:
    """The second process (here: a cleared in-process cache) reads verl's defaults from disk: same config."""
    from verl_safe_launch.compose import engine

    choose_verl(None)
    engine._BASES.clear()
    first = compose(ComposeRequest(overrides=cli_tokens(LINES)))
    engine._BASES.clear()
    again = compose(ComposeRequest(overrides=cli_tokens(LINES)))
    fresh_cfg, fresh_writes = engine._compose_fresh([], "ppo_trainer")
    base = engine._BASES[(str(engine.verl_config_dir()), "ppo_trainer")]
    assert OmegaConf.to_container(again.cfg) == OmegaConf.to_container(first.cfg)
    assert again.view == first.view
    assert OmegaConf.to_container(fresh_cfg) == OmegaConf.to_container(base.cfg)
    assert tuple(fresh_writes) == base.writes


def test_knowledge_is_regenerated_when_verl_changes(tmp_path: Path) -> None:
    package = tmp_path / "verl"
    (package / "version").mkdir(parents=True)
    (package / "trainer" / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "version" / "version").write_text("0.3.0.post1\n")
    config = package / "trainer" / "config" / "ppo_trainer.yaml"
    config.write_text("trainer:\n  n_gpus_per_node: 8\n")
    from verl_safe_launch.inputs import knowledge_dir

    choose_verl(tmp_path, "--verl")
    try:
        before = knowledge_dir()
        release = verl_release()
        assert release.version == "0.3.0.post1" and not release.tested
        assert release.config_keys == frozenset({"trainer.n_gpus_per_node"})
        config.write_text("trainer:\n  n_gpus_per_node: 8\n  nnodes: 1\n")
        choose_verl(tmp_path, "--verl")
        assert knowledge_dir() != before
        assert verl_release().config_keys == frozenset({"trainer.n_gpus_per_node", "trainer.nnodes"})
    finally:
        choose_verl(None)


def test_old_fork_gets_a_one_line_notice(tmp_path: Path) -> None:
    from verl_safe_launch.preflight import header_lines

    package = tmp_path / "verl"
    (package / "version").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "version" / "version").write_text("0.3.1\n")
    choose_verl(tmp_path, "--verl")
    try:
        lines = header_lines()
    finally:
        choose_verl(None)
    assert lines[0] == f"verl 0.3.1 at {package.resolve()} (--verl), not a tested release"
    assert lines[-1].startswith("verl 0.3.1 is older than the oldest release tested (0.5.0): checked: ")
    assert any(
        line.startswith("not judged for verl 0.3.1 (its config has no trainer.v1): ") for line in lines
    )


def generated_lines(seed: int, count: int, model: Path) -> list[list[str]]:
    """Batch configs over keys every release from 0.5.0 has (micro batches in each of their four forms)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        lines = [
            f"trainer.n_gpus_per_node={rng.choice([1, 2, 4, 6, 8])}",
            f"trainer.nnodes={rng.choice([1, 1, 2])}",
            f"data.train_batch_size={rng.choice([8, 12, 16, 32, 48, 64])}",
            f"actor_rollout_ref.rollout.n={rng.choice([1, 2, 4, 5, 8])}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={rng.choice([4, 8, 16, 32])}",
            f"algorithm.adv_estimator={rng.choice(['grpo', 'gae'])}",
            f"actor_rollout_ref.actor.use_kl_loss={rng.choice([True, False])}",
            f"actor_rollout_ref.model.path={model}",
            f"critic.model.path={model}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rng.choice([1, 2])}",
        ]
        for prefix, name in (
            ("actor_rollout_ref.actor", "ppo_micro_batch_size"),
            ("actor_rollout_ref.rollout", "log_prob_micro_batch_size"),
            ("actor_rollout_ref.ref", "log_prob_micro_batch_size"),
            ("critic", "ppo_micro_batch_size"),
        ):
            size = rng.choice([1, 2, 3, 4])
            lines += {
                "per_gpu": [f"{prefix}.{name}_per_gpu={size}"],
                "deprecated": [f"{prefix}.{name}={size * 8}", f"{prefix}.{name}_per_gpu=null"],
                "both": [f"{prefix}.{name}={size * 8}", f"{prefix}.{name}_per_gpu={size}"],
                "neither": [f"{prefix}.{name}_per_gpu=null"],
            }[rng.choice(["per_gpu", "per_gpu", "deprecated", "both", "neither"])]
        out.append(lines)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("chosen", RELEASES, indirect=True)
def test_check_rejects_what_the_releases_validation_rejects(chosen: Path, tmp_path: Path) -> None:
    """A differential per release: every config that release's own validation refuses, check refuses too."""
    from verl_safe_launch.audit import audit
    from verl_safe_launch.context import RuleContext
    from verl_safe_launch.findings import Severity
    from verl_safe_launch.rules import run_rules

    model = make_tiny_model(tmp_path / "tiny-model")
    cases = generated_lines(seed=int(chosen.name.replace(".", "")), count=40, model=model)
    composed = [compose(ComposeRequest(overrides=cli_tokens(lines))) for lines in cases]
    payload = json.dumps([OmegaConf.to_container(c.cfg, resolve=False) for c in composed])
    env = {**os.environ, "PYTHONPATH": str(chosen)}
    probe = [sys.executable, str(Path(__file__).with_name("release_oracle.py"))]
    out = subprocess.run(
        probe, input=payload, env=env, capture_output=True, text=True, timeout=600, check=True
    )
    verdicts = json.loads(out.stdout.strip().splitlines()[-1])
    rejected = misses = 0
    for lines, comp, theirs in zip(cases, composed, verdicts, strict=True):
        ours = [f for f in [*run_rules(RuleContext(comp.view)), *audit(comp)] if f.severity is Severity.ERROR]
        if theirs is not None:
            rejected += 1
            misses += not ours
            assert ours, f"verl {chosen.name} refuses ({theirs}) but check does not: {lines}"
    assert rejected, (
        f"verl {chosen.name} accepted all {len(cases)} generated configs: the probe judged nothing"
    )


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_run_launches_the_verl_it_checked(releases: Path, version: str, tmp_path: Path) -> None:
    """``run --verl DIR``: verl's own validation runs on that copy, and Ray's workers import it (PYTHONPATH).

    No GPU here: the nearest boundary is the dry run, which imports the copy and plans what Ray would get.
    """
    target = releases / version
    example = ROOT / "launch_examples" / "grpo_6gpu.yaml"
    cmd = [
        sys.executable,
        "-m",
        "verl_safe_launch",
        "run",
        "--dry-run",
        "--format",
        "json",
        "--verl",
        str(target),
    ]
    cmd += ["-c", str(example), "--run-dir", str(tmp_path / "run"), "--force"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VSL_HARDWARE_DETECT": "0"}
    done = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    if (
        version in NO_ENTRY_POINT
    ):  # its modules cannot be imported with this venv's packages: said, not a crash
        assert done.returncode == 3, done.stdout + done.stderr
        assert (
            f"verl at {target / 'verl'} (--verl) cannot be imported in this Python"
            in done.stdout + done.stderr
        )
        return
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    env_vars = report["plan"]["ray_init"]["runtime_env"]["env_vars"]
    assert env_vars["PYTHONPATH"].split(os.pathsep)[0] == str(target)
    assert report["plan"]["task_runner"] == "verl.trainer.main_ppo.TaskRunner"  # these releases' v0 runner


def test_a_verl_imported_from_elsewhere_is_not_launched_as_the_chosen_one(releases: Path) -> None:
    import verl  # the installed one, as this test process already has it

    from verl_safe_launch.errors import UsageError
    from verl_safe_launch.launch import import_chosen_verl

    assert verl.__file__ is not None
    choose_verl(releases / "0.8.0", "--verl")
    try:
        with pytest.raises(UsageError, match="verl was already imported from"):
            import_chosen_verl()
    finally:
        choose_verl(None)

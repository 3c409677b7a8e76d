"""Fuzz the verbs in-process with generated overrides, YAML and scripts: a documented exit code, never a traceback."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import unicodedata
from pathlib import Path

from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_safe_launch.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTED = {0, 1, 2}  # 3 needs a started launch; 4 (internal error) and 130 (Ctrl-C) must never happen here
KEYS = [
    "data.train_batch_size",
    "data.max_prompt_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.model.path",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "data",
    "hardware.nodes",
    "hardware.gpus_per_node",
    "hardware.gpu_memory_gb",
    "preset",
    "model_engine",
    "data.train_batch_size\u200b",  # keys drawn like verl's: a zero-width space, a Cyrillic letter
    "trainer.tot\u0430l_epochs",
]
VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            *("null", "", "${oops.x}", "${oc.env:NOPE}", "[1,2]", "{a: 1}", "small", "'x'", "true", "???"),
            *('!!float "abc"', '!!int "0xZZ"', "!!timestamp x", "a\u202eb\u200f", "\ufeff\u00ad\U000e0041"),
        ]
    ),
    st.text(alphabet="ab01.:-_$/{}[]'\"\\ ,=~+×", max_size=12),
)
OVERRIDE = st.builds(
    lambda p, k, v: f"{p}{k}={v}", st.sampled_from(["", "+", "++", "~"]), st.sampled_from(KEYS), VALUES
)
YAML_TEXT = st.one_of(
    st.builds(lambda k, v: f"{k}: {v}\n", st.sampled_from(KEYS), VALUES),
    st.text(alphabet="ab: -\n[]{}&*!#'\"\t.${}\u200b\u202e", max_size=80),
)
SCRIPT = st.builds(
    lambda pre, args: f"{pre}\npython3 -m verl.trainer.main_ppo {' '.join(args)}\n",
    st.one_of(
        st.text(alphabet="AB=$'\"\\{}()#;&|<> \n-", max_size=40),
        st.integers(1, 200).map(lambda n: "A=" + '"$(' * n + "echo x" + ')"' * n),  # nested past the limit
    ),
    st.lists(OVERRIDE, max_size=4),
)
OUT = st.sampled_from(["out.yaml", "x" * 256 + ".yaml"])  # a name the kernel refuses for its length
VERBS = st.sampled_from(["check", "show", "explain", "estimate", "audit", "migrate", "slurm", "presets"])


def _argv(verb: str, overrides: list[str], yaml_path: str, script: str, out: str = "out.yaml") -> list[str]:
    if verb in ("audit", "migrate"):
        return [verb, script, "-o", out] if verb == "migrate" else [verb, script, "--", *overrides]
    if verb == "slurm":
        return [verb, "--gpus-per-node", "2", "-c", yaml_path, "-o", "job.sbatch", *overrides]
    if verb == "presets":
        return [verb, *overrides[:1]]
    return [verb, "-c", yaml_path, *overrides]


WRITTEN = ("out.yaml", "job.sbatch", "job.yaml", "in.yaml", "in.sh", "outputs")


def _present(folder: Path) -> set[str]:
    return {name for name in WRITTEN if (folder / name).exists()}


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VERBS, st.lists(OVERRIDE, max_size=3), YAML_TEXT, SCRIPT, OUT)
def test_verbs_never_crash_and_write_only_where_told(
    verb: str, overrides: list[str], yaml_text: str, script: str, out_name: str
) -> None:
    cwd = os.getcwd()
    before = _present(Path(cwd)), _present(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "in.yaml").write_text(yaml_text)
        Path(tmp, "in.sh").write_text(script)
        out, err = io.StringIO(), io.StringIO()
        os.chdir(tmp)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(_argv(verb, overrides, "in.yaml", "in.sh", out_name))
        finally:
            os.chdir(cwd)
        assert code in DOCUMENTED, err.getvalue()
        assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue()
        shown = out.getvalue() + err.getvalue()
        assert not [c for c in shown if unicodedata.category(c) == "Cf"], (
            shown
        )  # every one shown as an escape
        written = {p.name for p in Path(tmp).iterdir()} - {"in.yaml", "in.sh"}
        assert written <= {"out.yaml", "job.sbatch", "job.yaml"}, written
    assert (_present(Path(cwd)), _present(ROOT)) == before  # nothing written outside the temporary directory

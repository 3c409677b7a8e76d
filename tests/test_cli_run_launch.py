"""The whole ``run`` path as a new user meets it: the installed command, no ``RAY_*`` variables, no ``~/.ray``.

A tiny generated model and parquet file go through the pre-flight, verl's validation, a new local Ray with token
auth (a token made for the run) and verl's own task runner. No GPU here, so one GPU is declared to Ray: verl's
resource check passes, verl creates its worker group, the memory hook lands in every worker, and the worker dies
where CUDA is first needed. Then: exit 3, the worker's error in one line with the stage it failed in, and every Ray
process of the run gone afterwards (by PID: seen in /proc while it ran, and named in the session's log files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import make_tiny_model

from verl_safe_launch.doctor import NO_CUDA_FIX
from verl_safe_launch.launch import NO_CUDA_NOTE, RUN_FILES, WORKERS_FILE, config_digest

pytestmark = pytest.mark.slow
COMMAND = Path(sys.executable).with_name("verl-safe-launch")
OVERRIDES = (
    "data.train_batch_size=2",
    "data.max_prompt_length=16",
    "data.max_response_length=16",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.logger=[console]",
    "+ray_kwargs.ray_init.include_dashboard=false",
    # without this Ray starts one idle worker per logical CPU when the driver connects (slow on 2 cores)
    "+ray_kwargs.ray_init._system_config.prestart_worker_first_driver=false",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "data.dataloader_num_workers=0",
)


def make_tiny_dataset(path: Path, rows: int = 4) -> Path:
    """A parquet file in verl's RL dataset layout (chat prompt, data source, ground truth)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "data_source": ["openai/gsm8k"] * rows,
            "prompt": [[{"role": "user", "content": f"the a of {i}"}] for i in range(rows)],
            "ability": ["math"] * rows,
            "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(rows)],
            "extra_info": [{"split": "train", "index": i} for i in range(rows)],
        }
    )
    pq.write_table(table, path)
    return path


@dataclass
class Launch:
    """One ``verl-safe-launch run --force`` in a fresh environment, and the Ray processes seen while it ran."""

    code: int
    err: str
    run_dir: Path
    ray_temp: Path
    home: Path
    seen: dict[int, dict[str, str]] = field(default_factory=dict)  # pid -> its RAY_AUTH_* variables
    cmdlines: dict[int, str] = field(default_factory=dict)  # pid -> its command line at its last look
    forks: set[int] = field(default_factory=set)  # seen only as the launcher's fork, before its exec

    def error_block(self) -> list[str]:
        """The launcher's own report: the last lines of stderr, from its ``error:`` line."""
        lines = self.err.splitlines()
        start = max(i for i, line in enumerate(lines) if line.startswith("error: "))
        return lines[start:]

    def session_logs(self) -> Path:
        return (self.ray_temp / "session_latest").resolve() / "logs"

    def worker_pids(self) -> dict[int, str]:
        """Every Ray worker process of the run (from its log file name) -> its actor or first task ('' if none)."""
        pids = {}
        for out in self.session_logs().glob("worker-*.out"):
            names = re.findall(r":(?:actor|task)_name:(\w+)", out.read_text(errors="replace"))
            pids[int(out.stem.rsplit("-", 1)[1])] = names[0] if names else ""
        return pids

    def all_pids(self) -> set[int]:
        logs = self.session_logs()
        named = {int(p.stem.rsplit("_", 1)[1]) for p in logs.glob("python-core-*_*.log")}
        return set(self.seen) | named | set(self.worker_pids())

    def alive(self) -> list[int]:
        """Processes of this run still running (a reused PID does not count: its command line names our dir)."""
        return [pid for pid in sorted(self.all_pids()) if str(self.ray_temp) in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> list[bytes] | None:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def _auth_env(raw: list[bytes]) -> dict[str, str]:
    pairs = (item.decode(errors="replace").partition("=") for item in raw if item.startswith(b"RAY_AUTH"))
    return {name: value for name, _, value in pairs}


def _watch(
    proc: subprocess.Popen[str], ray_temp: Path
) -> tuple[dict[int, dict[str, str]], dict[int, str], set[int]]:
    """Until ``proc`` exits: every process whose command line names the run's Ray temp dir, with its auth env.

    Each process is looked at again while it lives, and its last look counts: /proc shows a process's environment
    as it was at its exec, so a child looked at between fork and exec shows its parent's. A child of the launcher
    there has the launcher's command line and the environment the launcher was started with, from before the run
    made its token; those still unchanged at their last look come back apart, as forks, so that the token can be
    judged on the processes that exec'd with it while every process of the run still counts as one to outlive it.
    """
    seen: dict[int, dict[str, str]] = {}
    last_cmdline: dict[int, str] = {}
    launcher = ""
    while proc.poll() is None:
        launcher = launcher or _cmdline(proc.pid)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == proc.pid:
                continue
            pid = int(entry.name)
            cmdline = _cmdline(pid)
            if str(ray_temp) not in cmdline:
                continue
            raw = _environ(pid)
            if raw is not None and _cmdline(pid) == cmdline:  # both read from one image, not across an exec
                seen[pid] = _auth_env(raw)
                last_cmdline[pid] = cmdline
        time.sleep(0.2)
    forks = {pid for pid, cmdline in last_cmdline.items() if launcher and cmdline == launcher}
    return seen, last_cmdline, forks


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launch]]:
    ray_temp = Path(tempfile.mkdtemp(prefix="vslray"))  # short: Ray's socket paths must fit in 107 characters
    model = make_tiny_model(tmp_path / "tiny-model", weights=True)
    data = make_tiny_dataset(tmp_path / "train.parquet")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    # The multiprocessing dirs a killed process never removes go to a dir of this test's own (short: their
    # listener sockets must fit in 107 bytes; not ray_temp, whose path marks the processes of this run).
    mp_temp = Path(tempfile.mkdtemp(prefix="vslmp", dir="/tmp"))
    env["TMPDIR"] = str(mp_temp)
    runs: list[Launch] = []

    def run(*extra: str) -> Launch:
        run_dir = tmp_path / "run"
        argv = [str(COMMAND), "run", "--force", "--run-dir", str(run_dir)]
        argv += [
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files={data}",
            f"data.val_files={data}",
        ]
        argv += [*OVERRIDES, f"+ray_kwargs.ray_init._temp_dir={ray_temp}", *extra]
        with (tmp_path / "stderr.txt").open("w+") as sink:  # a file: Ray and verl are chatty
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=sink, text=True)
            seen, cmdlines, forks = _watch(proc, ray_temp)
            sink.seek(0)
            err = sink.read()
        result = Launch(proc.wait(), err, run_dir, ray_temp, home, seen, cmdlines, forks)
        runs.append(result)
        return result

    yield run
    for result in runs:  # never leave a process behind, even when an assertion failed
        for pid in result.alive():
            os.kill(pid, 9)
    shutil.rmtree(ray_temp, ignore_errors=True)
    shutil.rmtree(mp_temp, ignore_errors=True)


def _assert_clean_exit(result: Launch) -> None:
    """No Ray process of the run left, and the run's token only ever in the environment of Ray's processes."""
    assert result.seen, "no Ray process was seen"
    deadline = time.monotonic() + 20  # a worker still starting when the raylet stopped exits on its own
    while result.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert result.alive() == []
    execd = {pid: env for pid, env in result.seen.items() if pid not in result.forks}
    tokens = {env.get("RAY_AUTH_TOKEN") for env in execd.values()}
    assert len(tokens) == 1, {
        pid: (env, result.cmdlines[pid]) for pid, env in execd.items()
    }  # one for the whole run
    (token,) = tokens
    assert token and len(token) >= 32
    assert {env.get("RAY_AUTH_MODE") for env in execd.values()} == {"token"}
    assert not (result.home / ".ray").exists()
    for root in (result.run_dir, result.ray_temp):
        for path in root.rglob("*"):
            if path.is_file() and not path.is_socket():
                assert token.encode() not in path.read_bytes(), path
    assert token not in result.err


def test_run_on_a_fresh_machine_reaches_verls_workers_and_reports_where_they_failed(
    launch: Callable[..., Launch],
) -> None:
    result = launch("+ray_kwargs.ray_init.num_gpus=1")
    assert result.code == 3, result.err[-3000:]
    assert set(RUN_FILES) <= {p.name for p in result.run_dir.iterdir()}
    received = json.loads((result.run_dir / "task_runner.json").read_text())
    assert received["task_runner"] == "TaskRunnerV1"
    assert received["config_sha256"] == config_digest((result.run_dir / "config.yaml").read_text())
    assert received["matches_config_yaml"] is True
    assert "no GPU on this machine" in json.loads((result.run_dir / "preflight.json").read_text())["forced"]
    workers = result.worker_pids()
    records = [json.loads(line) for line in (result.run_dir / WORKERS_FILE).read_text().splitlines()]
    # the setup hook ran in every Ray worker process that ran an actor or a task, and only in Ray workers
    setup = {r["pid"] for r in records if r["event"] == "setup"}
    assert {pid for pid, name in workers.items() if name} <= setup <= set(workers)
    assert len(setup) == len([r for r in records if r["event"] == "setup"])  # once per process
    (worker_pid,) = [pid for pid, actor in workers.items() if actor == "WorkerDict"]  # verl's worker group
    patched = {r["pid"]: r for r in records if r["event"] == "patched"}
    assert "ActorRolloutRefWorker.init_model" in patched[worker_pid]["patched"]
    assert (patched[worker_pid]["cuda"], patched[worker_pid]["note"]) == (False, NO_CUDA_NOTE)
    assert patched[worker_pid]["cuda_visible_devices"] == "0"  # Ray gave it the declared GPU
    (memory,) = [json.loads(line) for line in (result.run_dir / "memory-0.jsonl").read_text().splitlines()]
    assert (memory["stage"], memory["status"], memory["pid"], memory["cuda"]) == (
        "init_model",
        "error",
        worker_pid,
        False,
    )
    first, where, fix = result.error_block()
    worker_line = (
        r"error: the launch failed in WorkerDict\.actor_rollout_init_model \(pid (\d+), [\d.]+\): (.*)"
    )
    match = re.fullmatch(worker_line, first)
    assert match is not None, first
    assert (int(match[1]), match[2]) == (worker_pid, memory["error"])  # the worker's own first error line
    assert where == (
        f"  where: stage init_model (ActorRolloutRefWorker.init_model), rank 0, pid {worker_pid} on "
        f"{memory['host']} (no CUDA device); run directory {result.run_dir}"
    )
    assert fix == f"  fix: {NO_CUDA_FIX}"
    _assert_clean_exit(result)

"""The ``oom`` verb: torch's and the engines' messages in real log shapes, the stage, and the ranked checklist."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import DATA, EXAMPLES, CliResult

from verl_safe_launch.doctor import find_ooms, scan_lines

LOGS = DATA / "oom"
EXAMPLE = str(EXAMPLES / "grpo_6gpu.yaml")
LOG_PROB_KNOB = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
FAILED = f"{LOG_PROB_KNOB}=40"  # the value the logged run used


@pytest.fixture(autouse=True)
def declared_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VSL_HARDWARE_DETECT", "0")


def test_torch_message_and_v1_stage() -> None:
    [event] = find_ooms(LOGS / "v1_compute_log_prob.log")
    assert (event.kind, event.stage, event.method) == ("torch", "old_log_prob", "compute_log_prob")
    assert (event.tried_gib, event.gpu, event.total_gib, event.free_gib) == (13.91, 0, 79.11, 6.56)
    assert event.in_use_gib == 72.54 and event.needed_gib == pytest.approx(86.45)
    assert event.where.endswith("v1_compute_log_prob.log:28")


def test_old_torch_message_and_legacy_worker() -> None:
    [event] = find_ooms(LOGS / "legacy_update_actor.log")
    assert (event.stage, event.method) == ("actor_update", "update_actor")  # the outermost worker method
    assert (event.tried_gib, event.total_gib, event.in_use_gib, event.free_gib) == (4.64, 79.15, 70.02, 3.21)


def test_vllm_kv_cache_failure_is_the_rollout() -> None:
    [event] = find_ooms(LOGS / "vllm_kv_cache.log")
    assert (event.kind, event.stage) == ("kv-cache", "rollout")
    assert "smaller than one sequence of max_model_len" in event.detail


MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 3 has a total capacity of "
)
MESSAGE += "23.64 GiB of which 100.25 MiB is free. Including non-PyTorch memory, this process has 23.53 GiB memory in use."


@pytest.mark.parametrize(
    ("frames", "stage"),
    [
        (
            [
                '  File "fsdp_workers.py", line 9, in compute_ref_log_prob',
                '  File "dp_actor.py", line 3, in compute_log_prob',
            ],
            "ref_log_prob",
        ),
        (['  File "fsdp_workers.py", line 9, in compute_values'], "critic_values"),
        (['  File "fsdp_workers.py", line 9, in update_critic'], "critic_update"),
        (
            [
                "ray.exceptions.RayTaskError(OutOfMemoryError): ray::WorkerDict.actor_rollout_update_actor() (pid=1)"
            ],
            "actor_update",
        ),
        (['  File "engine_workers.py", line 728, in update_weights'], "weight_sync"),
        (['  File "/x/vllm/v1/worker/gpu_model_runner.py", line 2, in _dummy_run'], "rollout"),
        (['  File "train.py", line 1, in main'], None),
    ],
)
def test_stage_from_the_traceback(frames: list[str], stage: str | None) -> None:
    [event] = scan_lines(["Traceback (most recent call last):", *frames, MESSAGE], "log")
    assert event.stage == stage
    assert event.tried_gib == 0.5 and event.free_gib == pytest.approx(0.098, abs=0.001)


def test_log_prob_oom_proposes_a_smaller_micro_batch(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "v1_compute_log_prob.log"), "-c", EXAMPLE, FAILED, "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["stage"] == "old log-prob" and data["knob"] == LOG_PROB_KNOB and data["knob_value"] == 40
    assert data["scale"] > 1  # the process needed 86.45 GiB: the model is scaled up to that
    remedies = data["remedies"]
    freed = [r["freed_gib"] for r in remedies]
    assert freed == sorted(freed, reverse=True) and all(f > 0 for f in freed)
    micro = next(r for r in remedies if r["overrides"][0].startswith(LOG_PROB_KNOB + "="))
    assert data["paste"] == micro["overrides"]  # the stage's own knob: nothing else about the run changes
    assert 1 <= int(micro["overrides"][0].split("=")[1]) < 40
    assert micro["peak_gib"] * 1.1 <= 79.1  # judged against the GPU in torch's message
    offload = next(r for r in remedies if "param_offload=true" in " ".join(r["overrides"]))
    assert offload["peak_gib"] < data["estimated_gib"] * data["scale"]


def test_text_report_names_stage_knob_and_paste(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "v1_compute_log_prob.log"), "-c", EXAMPLE, FAILED)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("out of memory in stage old log-prob (compute_log_prob) at ")
    assert f"  knob: {LOG_PROB_KNOB} = 40" in lines
    assert any("scaled ×" in line for line in lines)
    assert lines[-1].startswith("paste: ")


def test_run_directory_with_records_and_worker_logs(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    logs = tmp_path / "ray" / "logs"
    logs.mkdir(parents=True)
    shutil.copy(LOGS / "legacy_update_actor.log", logs / "worker-9120.err")
    record = {"stage": "actor_update", "status": "oom", "time": 1.0, "cuda": True, "peak_allocated_gib": 74.7}
    (tmp_path / "memory-0.jsonl").write_text(json.dumps(record) + "\n")
    r = cli("oom", str(tmp_path), "-c", EXAMPLE, "hardware.gpu_memory_gb=80", "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["where"] == "ray/logs/worker-9120.err:11" and data["stage"] == "actor update"
    assert data["knob"] == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def test_rollout_kv_cache_checklist(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "vllm_kv_cache.log"), "-c", EXAMPLE, "hardware.gpu_memory_gb=80")
    assert r.code == 0, r.err
    assert "out of memory in stage rollout" in r.out
    assert "vLLM's KV cache is smaller than one sequence of max_model_len" in r.out


def test_no_oom_in_the_log_is_an_input_error(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    log = tmp_path / "fine.log"
    log.write_text("step:1 - all good\n")
    r = cli("oom", str(log), "-c", EXAMPLE)
    assert r.code == 2
    assert r.err.startswith(f"error: no out-of-memory error found in {log}")


def test_run_directory_with_only_the_memory_record(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    record = {
        "stage": "old_log_prob",
        "status": "oom",
        "time": 2.0,
        "cuda": True,
        "error": "OutOfMemoryError: CUDA out of memory.",
        "peak_allocated_gib": 70.0,
        "device_total_gib": 79.1,
    }
    (tmp_path / "memory-1.jsonl").write_text("not json\n" + json.dumps(record) + "\n")
    r = cli("oom", str(tmp_path), "-c", EXAMPLE, FAILED, "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["kind"] == "record" and data["stage"] == "old log-prob" and data["scale"] > 1
    assert data["paste"][0].startswith(LOG_PROB_KNOB + "=")


def test_run_directory_config_is_used_when_no_config_is_given(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    shown = cli("show", "-c", EXAMPLE, FAILED)
    assert shown.code == 0, shown.err
    (tmp_path / "config.yaml").write_text(shown.out)
    shutil.copy(LOGS / "v1_compute_log_prob.log", tmp_path / "driver.log")
    r = cli("oom", str(tmp_path), "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["knob_value"] == 40 and data["notes"][0].startswith(f"config: {tmp_path / 'config.yaml'}")
    bare = json.loads(cli("oom", str(LOGS / "legacy_update_actor.log"), "--format", "json").out)
    assert bare["notes"][0].startswith("no config given: the checklist is ranked from the log alone")
    assert bare["paste"] == [] and bare["knob_value"] is None
    defaults = json.loads(
        cli(
            "oom", str(LOGS / "legacy_update_actor.log"), "data.max_response_length=512", "--format", "json"
        ).out
    )
    assert defaults["notes"][0].startswith("no config given (-c FILE with the run's config)")


@pytest.mark.parametrize(
    ("log", "first", "freed"),
    [
        (
            "v1_compute_log_prob.log",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu: halve it",
            13.91 / 2,
        ),
        (
            "entropy_update_actor.log",
            "actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking=true",
            9.27,
        ),
        (
            "container_zero_bytes.log",
            "+ray_kwargs.ray_init.runtime_env.env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            None,
        ),
        ("legacy_update_critic.log", "critic.ppo_infer_max_token_len_per_gpu: halve it", 2.19 / 2),
    ],
)
def test_without_a_config_the_checklist_is_ranked_from_the_log_alone(
    cli: Callable[..., CliResult], log: str, first: str, freed: float | None
) -> None:
    """No config: no value is known, so nothing to paste; the log's own numbers rank what each change frees
    (the failed allocation grows with the micro batch's tokens; reserved-but-unallocated is what expandable
    segments give back), and what only the config can size comes last."""
    text = cli("oom", str(LOGS / log))
    assert text.code == 0, text.err
    assert "checklist (" in text.out and "\npaste:" not in text.out
    assert "verl-safe-launch oom LOG -c CONFIG" in text.out
    data = json.loads(cli("oom", str(LOGS / log), "--format", "json").out)
    remedies = data["remedies"]
    assert remedies[0]["overrides"][0] == first
    if freed is not None:
        assert remedies[0]["freed_gib"] == pytest.approx(freed, abs=0.01)
    sized = [r["freed_gib"] for r in remedies if r["freed_gib"] is not None]
    assert sized == sorted(sized, reverse=True)
    unsized = [i for i, r in enumerate(remedies) if r["freed_gib"] is None]
    assert unsized and min(unsized) >= len(sized)  # what the log cannot size comes last


def big_log(path: Path, megabytes: int) -> Path:
    """``megabytes`` of log noise (and one 8 MiB line without a newline), then the real OOM log at the end."""
    noise = ("(TaskRunner pid=1) step:1 - actor/loss:0.125 " * 24 + "\n").encode()
    block = noise * (1024 * 1024 // len(noise) + 1)
    with path.open("wb") as out:
        for _ in range(megabytes):
            out.write(block[: 1024 * 1024])
        out.write(b"x" * (8 << 20) + b"\n")
        out.write((LOGS / "v1_compute_log_prob.log").read_bytes())
    return path


def test_a_large_log_is_streamed_in_bounded_memory(tmp_path: Path) -> None:
    """A 160 MiB log: the scan's peak Python allocation stays below 2 MiB (reading it whole took ~2.7× its size)."""
    import tracemalloc

    log = big_log(tmp_path / "worker.log", 160)
    tracemalloc.start()
    try:
        [event] = find_ooms(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (event.stage, event.method, event.tried_gib) == ("old_log_prob", "compute_log_prob", 13.91)
    assert peak < 2 << 20


def test_many_oom_lines_are_counted_up_to_a_limit(tmp_path: Path) -> None:
    from verl_safe_launch.doctor import MAX_EVENTS

    line = (LOGS / "v1_compute_log_prob.log").read_text().splitlines()
    message = next(text for text in line if "CUDA out of memory" in text)
    log = tmp_path / "many.log"  # distinct errors: one printed twice counts once
    tried = re.compile(r"Tried to allocate [\d.]+ GiB")
    log.write_text(
        "".join(
            tried.sub(f"Tried to allocate {i + 1}.00 MiB", message) + "\n" for i in range(MAX_EVENTS + 50)
        )
    )
    assert len(find_ooms(log)) == MAX_EVENTS


def test_a_model_outside_the_table_is_named_not_asked_for(cli: Callable[..., CliResult]) -> None:
    model = "some-org/not-a-bundled-model"
    r = cli(
        "oom", str(LOGS / "v1_compute_log_prob.log"), "-c", EXAMPLE, f"actor_rollout_ref.model.path={model}"
    )
    assert r.code == 0, r.err
    assert f"no architecture for actor_rollout_ref.model.path={model}: no config.json there" in r.out
    assert "pass -c" not in r.out


@pytest.mark.parametrize(
    ("log", "kind", "stage"),
    [
        ("vllm_wake_up_cumem.log", "wake-up", "rollout"),
        ("ray_host_update_actor.log", "host", "actor_update"),
        ("ray_task_update_actor.log", "ray-task", "actor_update"),
        ("other_process.log", "torch", "old_log_prob"),
        ("entropy_update_actor.log", "torch", "actor_update"),
    ],
)
def test_each_failure_pattern_is_one_error_with_its_stage(log: str, kind: str, stage: str) -> None:
    """The worker's message and Ray's (or the engine's) second print of it are one error."""
    [event] = find_ooms(LOGS / log)
    assert (event.kind, event.stage) == (kind, stage)


def test_one_error_printed_by_the_worker_and_again_by_the_driver_counts_once(
    cli: Callable[..., CliResult],
) -> None:
    text = (LOGS / "entropy_update_actor.log").read_text()
    assert text.count("CUDA out of memory.") == 2 and "RayTaskError(OutOfMemoryError)" in text
    r = cli("oom", str(LOGS / "entropy_update_actor.log"), "-c", EXAMPLE, "--format", "json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["errors_found"] == 1


def test_wake_up_failure_lowers_the_memory_fraction(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "vllm_wake_up_cumem.log"), "-c", EXAMPLE, "hardware.gpu_memory_gb=80")
    assert r.code == 0, r.err
    assert "(the rollout engine waking up)" in r.out.splitlines()[0]
    assert "paste: actor_rollout_ref.rollout.gpu_memory_utilization=0.4" in r.out
    assert "still holds one sequence of max_model_len" in r.out  # re-checked: vLLM would still start


def test_host_memory_kill_names_the_update_and_host_fixes(cli: Callable[..., CliResult]) -> None:
    r = cli(
        "oom",
        str(LOGS / "ray_host_update_actor.log"),
        "-c",
        EXAMPLE,
        "hardware.gpu_memory_gb=80",
        "data.dataloader_num_workers=8",
        "--format",
        "json",
    )
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["kind"] == "host" and data["stage"] == "actor update"
    assert "RAY_memory_usage_threshold" in data["fix"]
    assert data["paste"] == ["data.dataloader_num_workers=2"]
    assert all(r["peak_gib"] * 1.1 <= 80 for r in data["remedies"])  # each still fits the GPU


def test_ray_task_error_without_torch_line_gets_the_stage_checklist(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "ray_task_update_actor.log"), "-c", EXAMPLE, "hardware.gpu_memory_gb=80")
    assert r.code == 0, r.err
    assert r.out.startswith("out of memory in stage actor update (update_actor)")
    assert "paste: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=" in r.out


def test_another_process_filling_the_gpu_is_the_fix_not_the_batch(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "other_process.log"), "-c", EXAMPLE, "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["other_processes"] == [{"pid": 2914, "gib": 77.96}]  # not the failing process 3377 itself
    assert data["remedies"] == [] and data["paste"] == []
    assert data["fix"].startswith("free GPU 0: process 2914 holds 78.0 GiB, this process only 0.9 GiB")


def test_own_process_in_torchs_list_is_not_another_process() -> None:
    [event] = find_ooms(LOGS / "v1_compute_log_prob.log")
    assert event.others_gib == ()


def test_entropy_failure_pastes_chunking(cli: Callable[..., CliResult]) -> None:
    r = cli("oom", str(LOGS / "entropy_update_actor.log"), "-c", EXAMPLE, "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["in_entropy"] and data["stage"] == "actor update"
    assert data["paste"] == ["actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking=true"]
    chunking = data["remedies"][0]
    assert chunking["freed_gib"] > 0  # applied to the config as run and re-estimated
    assert all(r["freed_gib"] > 0 for r in data["remedies"])  # entropy_checkpointing only where it frees some


# --- real log shapes: the failing process listed by the driver's pid, lower-case engine errors, fragmentation ---


def test_container_log_lists_the_failing_process_as_any_other() -> None:
    """verl-project/verl#2828: inside a container torch does not recognise its own process and lists it as
    "Process 23444 has 70.25 GiB memory in use", with no "this process has" sentence. PyTorch's pool (60.49 GiB
    allocated + 6.77 GiB reserved) plus 3 GiB of CUDA context is that entry: the process itself, not another."""
    [event] = find_ooms(LOGS / "container_entropy_log_prob.log")
    assert (event.stage, event.in_entropy) == ("old_log_prob", True)
    assert event.own_pid == 23444 and event.in_use_gib == 70.25 and event.others_gib == ()
    assert (event.pytorch_gib, event.unallocated_gib) == (60.49, 6.77)
    assert event.fragmented  # 8.85 GiB free + 6.77 GiB held unused would have held the 13.91 GiB asked for


def test_container_log_gets_the_stage_checklist_not_stop_the_other_process(
    cli: Callable[..., CliResult],
) -> None:
    r = cli("oom", str(LOGS / "container_entropy_log_prob.log"), "-c", EXAMPLE, "--format", "json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["fix"] is None and data["other_processes"] == []
    assert any("process 23444 in torch's list is the failing process itself" in n for n in data["notes"])
    assert data["paste"] == ["actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking=true"]
    expandable = next(r for r in data["remedies"] if "PYTORCH_CUDA_ALLOC_CONF" in r["overrides"][0])
    assert expandable["overrides"] == [
        "+ray_kwargs.ray_init.runtime_env.env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    ]
    assert expandable["freed_gib"] == 6.77


def test_the_expandable_segments_override_composes(cli: Callable[..., CliResult]) -> None:
    """The advice is applied to the config before it is shown: verl's Hydra config takes it as an env var."""
    key = "ray_kwargs.ray_init.runtime_env.env_vars.PYTORCH_CUDA_ALLOC_CONF"
    r = cli("show", "-c", EXAMPLE, f"+{key}=expandable_segments:True", "--format", "json")
    assert r.code == 0, r.err
    assert "expandable_segments:True" in r.out


def test_zero_bytes_in_this_process_means_torch_did_not_find_itself() -> None:
    """ "this process has 0 bytes memory in use" (real containers) and "Process 1 has": PID 1 is the worker."""
    [event] = find_ooms(LOGS / "container_zero_bytes.log")
    assert event.own_pid == 1 and event.in_use_gib == 78.12 and event.others_gib == ()
    assert event.needed_gib == pytest.approx(78.12 + 1.72)


def test_another_process_is_still_another_process_when_pytorch_holds_little() -> None:
    """The own entry is PyTorch's pool plus at most a few GiB: a 78 GiB stranger beside a 0.4 GiB pool stays one."""
    [event] = find_ooms(LOGS / "other_process.log")
    assert event.others_gib == ((2914, 77.96),) and event.in_use_gib == 0.904  # torch knew its own: 3377


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: cuda error: out of memory at /workspace/csrc/cumem_allocator.cpp:62",  # verl#302's title
        "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62",
        "pfw8b: HTTP 500  CUDA error: out of memory      cumem_allocator.cpp:139",
    ],
)
def test_wake_up_failure_in_every_spelling(line: str) -> None:
    [event] = scan_lines([line], "log")
    assert (event.kind, event.stage) == ("wake-up", "rollout")


def test_lower_case_wake_up_log_is_the_rollout_waking_up() -> None:
    [event] = find_ooms(LOGS / "vllm_wake_up_lowercase.log")
    assert (event.kind, event.stage) == ("wake-up", "rollout")


def test_torch_message_matched_whatever_its_case() -> None:
    line = (LOGS / "v1_compute_log_prob.log").read_text().splitlines()[-1]
    [event] = scan_lines([line.lower()], "log")
    assert (event.tried_gib, event.total_gib, event.pytorch_gib) == (13.91, 79.11, 65.3)


def test_critic_oom_gets_the_critics_own_knobs(cli: Callable[..., CliResult]) -> None:
    """A critic update's failure (a log in the legacy worker's shape) is fitted on the critic's token budget,
    and no actor switch is offered as the critic's own."""
    r = cli(
        "oom",
        str(LOGS / "legacy_update_critic.log"),
        "-c",
        EXAMPLE,
        "algorithm.adv_estimator=gae",
        "critic.model.path=Qwen/Qwen2.5-0.5B",
        "--format",
        "json",
    )
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["stage"] == "critic" and data["knob"] == "critic.ppo_infer_max_token_len_per_gpu"
    assert data["paste"][0].startswith("+critic.ppo_infer_max_token_len_per_gpu=")
    assert int(data["paste"][0].split("=")[1]) < 32768  # below the CriticConfig default the run used
    actor = [r for r in data["remedies"] if "actor.fsdp_config" in " ".join(r["overrides"])]
    assert all("resident beside this stage" in r["why"] for r in actor)


def test_dynamic_batching_is_offered_for_a_fixed_micro_batch(cli: Callable[..., CliResult]) -> None:
    r = cli(
        "oom",
        str(LOGS / "legacy_update_actor.log"),
        "-c",
        EXAMPLE,
        "hardware.gpu_memory_gb=80",
        "--format",
        "json",
    )
    assert r.code == 0, r.err
    data = json.loads(r.out)
    dynamic = next(r for r in data["remedies"] if "use_dynamic_bsz=true" in " ".join(r["overrides"]))
    switch, budget = dynamic["overrides"]
    assert switch == "actor_rollout_ref.actor.use_dynamic_bsz=true"
    assert budget.startswith("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=")
    assert dynamic["peak_gib"] * 1.1 <= 80
    again = cli(
        "oom",
        str(LOGS / "legacy_update_actor.log"),
        "-c",
        EXAMPLE,
        "hardware.gpu_memory_gb=80",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "--format",
        "json",
    )
    assert not any("use_dynamic_bsz" in " ".join(r["overrides"]) for r in json.loads(again.out)["remedies"])

"""``run`` (the default verb): pre-flight, run directory, verl's validation, then verl's trainer on Ray."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_safe_launch.cli._common import (
    add_compose_args,
    add_config_name_args,
    compose_from_args,
    make_parser,
    parse,
    print_json,
)
from verl_safe_launch.errors import EXIT_LAUNCH, EXIT_OK, EXIT_PREFLIGHT, UsageError, VslError
from verl_safe_launch.files import check_text
from verl_safe_launch.findings import Finding
from verl_safe_launch.launch import LaunchPlan, plan_launch, render_plan, rundir
from verl_safe_launch.preflight import Preflight, launch_preflight
from verl_safe_launch.render import escape_lines, json_document, json_text, render_findings_text

EXAMPLES = """\
  verl-safe-launch -c launch_examples/grpo_6gpu.yaml
  verl-safe-launch preset=medium actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct data.train_files=train.parquet
  verl-safe-launch run --dry-run -c launch_examples/grpo_6gpu.yaml --run-dir /tmp/grpo-plan
  RAY_ADDRESS=10.0.0.1:6379 verl-safe-launch run -c my_run.yaml
"""
FORCE_HELP = (
    "launch anyway: past pre-flight errors, into a non-empty run directory, on a machine without GPUs, "
    "or on a cluster with fewer GPUs than the config needs (recorded in preflight.json)"
)
NO_GPU = (
    "No GPU on this machine: the pre-flight passed and nothing was started. On a machine with GPUs this runs:"
)


@dataclass
class Outcome:
    """What ``run`` reports: text as it goes, or one JSON object at the end (with the verdict once the
    pre-flight has run)."""

    json: bool
    data: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] | None = None

    def say(self, text: str) -> None:
        """One block of the text report (nothing in JSON mode)."""
        if not self.json:
            print(escape_lines(text), flush=True)  # paths and values from the command line are shown escaped

    def finish(self, status: str, code: int) -> int:
        """Emit the JSON object (in JSON mode) and return the exit code."""
        if self.json:
            print_json(json_document({"status": status, "exit_code": code, **self.data}, self.findings))
        return code


def main(args: Sequence[str], offset: int) -> int:
    """Run ``run``."""
    parser = make_parser(
        "run", "Pre-flight, then launch verl's trainer on Ray with memory logging.", EXAMPLES
    )
    parser.add_argument(
        "--run-dir", type=rundir.run_dir_arg, help="run directory (default outputs/<date>/<time>)"
    )
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument(
        "--dry-run", action="store_true", help="stop after the run directory and verl's validation"
    )
    parser.add_argument(
        "--attach",
        action="store_true",
        help="run on the Ray cluster this process belongs to (RAY_ADDRESS, as in a Ray job); never start one",
    )
    add_compose_args(parser)
    add_config_name_args(parser)
    ns = parse(parser, args)
    out = Outcome(ns.format == "json")
    try:
        return _run(ns, args, offset, out)
    except VslError as exc:
        out.data["error"] = exc.render()
        out.finish("error", exc.exit_code)
        raise


def _run(ns: argparse.Namespace, args: Sequence[str], offset: int, out: Outcome) -> int:
    composed = compose_from_args(ns, args, offset)
    pre = launch_preflight(composed, "run")
    out.findings = list(pre.findings)
    out.say(render_findings_text(pre.findings).rstrip("\n"))
    forced: list[str] = []
    if not pre.ok:
        if not ns.force:
            out.say("Nothing was started: fix the errors above, or pass --force to launch anyway.")
            return out.finish("preflight-failed", EXIT_PREFLIGHT)
        forced.append("pre-flight errors")
    cfg = rundir.resolved_config(composed)
    for text in (*args, os.getcwd()):  # each is written into the run directory: refuse before creating it
        check_text(text, where="command line" if text in args else "working directory")
    with rundir.created_run_dir(ns.run_dir, ns.force, forced) as run_dir:
        rundir.write_run_dir(
            run_dir, cfg, composed, pre.findings, args, list(ns.overrides), forced, ns.config
        )
    out.data["run_dir"] = str(run_dir)
    out.say(f"run directory: {run_dir}")
    import_path = _import_chosen_verl()
    if _validate(cfg, run_dir):
        out.say("verl's validate_config: passed")
    else:
        out.say(
            "verl's validate_config: this verl has none before Ray (its trainer validates the config once started)"
        )
    plan = plan_launch(cfg, composed.view, run_dir, os.environ, import_path)
    out.data["plan"] = plan.to_json()
    if ns.attach and plan.address is None:
        raise UsageError(
            "--attach: there is no Ray cluster to attach to",
            where="RAY_ADDRESS / ray_kwargs.ray_init.address",
            fix="run it as a Ray job (verl-safe-launch submit sets this up), or set RAY_ADDRESS",
        )
    if ns.dry_run:
        out.say("Dry run: nothing was started. This is what would launch:\n" + render_plan(plan))
        return out.finish("dry-run", EXIT_OK)
    if plan.address is None and _local_gpus() == 0:
        if not ns.force:
            out.say(NO_GPU + "\n" + render_plan(plan))
            return out.finish("no-gpu", EXIT_OK)
        forced.append("no GPU on this machine")
        _record_forced(run_dir, pre, forced)
    if plan.address is None:
        _check_model(cfg, plan)
    out.say("launching:\n" + render_plan(plan))
    return _launch(cfg, plan, pre, forced, ns.force, out)


def _check_model(cfg: Any, plan: LaunchPlan) -> None:
    """A local Ray loads the model on this machine: stop before Ray starts if it cannot be loaded here."""
    from verl_safe_launch.launch import model_access_error

    model = cfg.actor_rollout_ref.model
    path, trust = model.get("path"), bool(model.get("trust_remote_code", False))
    error = model_access_error(str(path), os.environ, plan.run_dir, trust) if path else None
    if error is not None:
        raise error


def _validate(cfg: Any, run_dir: Path) -> bool:
    from verl_safe_launch.launch import validate_with_verl

    before = rundir.render_config(cfg)
    validated = validate_with_verl(cfg)
    after = rundir.render_config(cfg)
    if after != before:  # auto_set_device may switch trainer.device: record what verl will receive
        rundir.atomic_write(run_dir / rundir.CONFIG_FILE, after)
    return validated


def _import_chosen_verl() -> str | None:
    from verl_safe_launch.launch import import_chosen_verl

    return import_chosen_verl()


def _local_gpus() -> int:
    from verl_safe_launch.launch import local_gpu_count

    return local_gpu_count()


def _record_forced(run_dir: Path, pre: Preflight, forced: list[str]) -> None:
    preflight = rundir.preflight_json(pre.findings, forced)
    rundir.atomic_write(run_dir / "preflight.json", json_text(preflight))


def _launch(cfg: Any, plan: LaunchPlan, pre: Preflight, forced: list[str], force: bool, out: Outcome) -> int:
    from verl_safe_launch.launch import verl_handoff as handoff

    failure: VslError | None = None
    with handoff.ray_session(plan):
        try:
            _check_cluster(plan, pre, forced, force, out)
            handoff.submit(cfg, plan)
        except VslError as exc:
            failure = exc
    return after_run(plan, pre, failure, out)


def _check_cluster(plan: LaunchPlan, pre: Preflight, forced: list[str], force: bool, out: Outcome) -> None:
    from verl_safe_launch.launch import verl_handoff as handoff

    resources = handoff.cluster_resources()
    where = f"Ray cluster {plan.address or '(local)'}; run directory {plan.run_dir}"
    cpu_error = handoff.check_cpus(plan.cpus, resources, where)
    if cpu_error is not None:
        raise cpu_error
    gpu_error = handoff.check_gpus(plan.gpus, resources, where)
    if gpu_error is None:
        _check_nodes(pre, where, force, forced)
        return
    if not force:
        raise gpu_error
    forced.append(gpu_error.what)
    _record_forced(plan.run_dir, pre, forced)
    out.say(f"warning: {gpu_error.what} (launching anyway: --force)")


def _check_nodes(pre: Preflight, where: str, force: bool, forced: list[str]) -> None:
    """Per node, as verl places its bundle sets; then verl's placement groups, with a deadline."""
    from verl_safe_launch.launch import blocking, live_nodes, node_findings, node_need, probe_placement

    need = node_need(pre.context.view)
    nodes = live_nodes()
    stop = blocking(node_findings(nodes, need, where))
    if stop is not None:
        if not force:
            raise stop
        forced.append(stop.what)
        return
    probe_placement(need, nodes)


def after_run(plan: LaunchPlan, pre: Preflight, failure: VslError | None, out: Outcome) -> int:
    """Report how the launch ended: an OOM record in the run directory wins over the Ray error it caused
    (exit 3 with the fix); another failure is raised; else measured against estimated peaks (exit 0)."""
    from verl_safe_launch.doctor import postmortem

    records = postmortem.read_records(plan.run_dir)
    oom = postmortem.first_oom(records)
    if oom is not None:
        report = postmortem.oom_report(oom, pre.context, postmortem.load_fit())
        out.data["oom"] = {"stage": report.stage, "override": report.override}
        print(report.render(plan.run_dir), file=sys.stderr)
        return out.finish("oom", EXIT_LAUNCH)
    if failure is not None:
        failed = postmortem.first_failure(records)
        if failed is not None:
            out.data["failed_stage"] = failed.get("stage")
        raise postmortem.failure_report(failure, failed, plan.run_dir)
    out.say(postmortem.render_peaks(records, postmortem.estimated_peaks(pre.context)))
    out.data["measured"] = postmortem.measured_peaks(records)
    return out.finish("finished", EXIT_OK)

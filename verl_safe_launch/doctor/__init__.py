"""After a failure: the OOM log reader, the diagnosis with ranked fixes, and the post-mortem of a run."""

from __future__ import annotations

from verl_safe_launch.doctor.log_only import diagnose_log_only
from verl_safe_launch.doctor.oom_doctor import Diagnosis, Remedy, diagnose
from verl_safe_launch.doctor.oom_log import MAX_EVENTS, OomEvent, find_ooms, scan_lines
from verl_safe_launch.doctor.postmortem import (
    NO_CUDA_FIX,
    NO_FIT,
    failure_report,
    first_failure,
    first_oom,
    load_fit,
    oom_report,
    read_records,
    render_peaks,
)
from verl_safe_launch.doctor.report import diagnosis_json, render_diagnosis

__all__ = [
    "MAX_EVENTS",
    "NO_CUDA_FIX",
    "NO_FIT",
    "Diagnosis",
    "OomEvent",
    "Remedy",
    "diagnose",
    "diagnose_log_only",
    "diagnosis_json",
    "failure_report",
    "find_ooms",
    "first_failure",
    "first_oom",
    "load_fit",
    "oom_report",
    "read_records",
    "render_diagnosis",
    "render_peaks",
    "scan_lines",
]

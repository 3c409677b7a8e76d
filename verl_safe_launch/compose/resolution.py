"""The composed config as verl will read it: every interpolation resolves, every section verl reads is a mapping."""

from __future__ import annotations

from typing import Any

from verl_safe_launch.compose.engine import Composed, resolves_flat
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.provenance import Layer, Source

UNSET_ENV = "Environment variable"
"""How OmegaConf's oc.env resolver words a variable that is not set."""
_RESOLVE_FIXES = (
    ("Recursive", "the interpolation refers to itself: write a value, or point it at another key"),
    (
        UNSET_ENV,
        "export the variable before launching, or give a default: ${{oc.env:NAME,default}}",
    ),
    (
        "Unsupported interpolation type",
        "use one of OmegaConf's resolvers (oc.env, oc.select, oc.decode, ...)",
    ),
    ("not found", "set the key it refers to, or write a value instead of '{raw}'"),
)


def resolution_findings(composed: Composed, job: str | None = None) -> list[Finding]:
    """One error per leaf whose interpolation OmegaConf (and so verl and ``run``) cannot resolve. For a job
    written to run elsewhere (``job``: ``slurm``, ``kuberay``), an environment variable unset here is read where
    the job runs: a warning naming where to set it."""
    findings: list[Finding] = []
    if composed.cfg is None or resolves_flat(composed.cfg):
        return findings  # a script audit composes the flat view only; or nothing fails to resolve
    for key, prov in composed.view.provenance.items():
        if prov.interpolation is None:
            continue
        problem = _resolve_problem(composed.cfg, key)
        if problem is not None:
            raw = str(prov.interpolation)
            fix = next(
                (f for marker, f in _RESOLVE_FIXES if marker in problem), "write a value that resolves"
            )
            if job is not None and UNSET_ENV in problem:
                findings.append(_elsewhere(key, raw, problem, prov.source, job))
                continue
            findings.append(
                Finding(
                    "config-unresolved",
                    Severity.ERROR,
                    (key,),
                    f"{key}={raw} does not resolve: {problem}; verl stops when it reads it",
                    f"{key}: " + fix.format(raw=raw),
                    ((key, raw, prov.source),),
                )
            )
    return findings


def _elsewhere(key: str, raw: str, problem: str, source: Source, job: str) -> Finding:
    """An ``${oc.env:NAME}`` unset here, in a job that runs elsewhere with the environment it is given there."""
    where = (
        "sbatch passes the environment it runs in on to the job"
        if job == "slurm"
        else "set it in the job's pod"
    )
    return Finding(
        "config-unresolved",
        Severity.WARNING,
        (key,),
        f"{key}={raw} does not resolve here ({problem}); the {job} job reads it where it runs ({where}), "
        "and verl stops there if it is unset",
        f"{key}: export the variable where the job is submitted from, or give a default: ${{oc.env:NAME,default}}",
        ((key, raw, source),),
    )


def _resolve_problem(cfg: Any, key: str) -> str | None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except (OmegaConfBaseException, ValueError, TypeError, RecursionError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def structure_findings(composed: Composed) -> list[Finding]:
    """An error for each top-level section of verl's config that was deleted or replaced by a plain value."""
    sections = {
        w.key.split(".", 1)[0] for w in composed.writes if w.source.layer is Layer.VERL and "." in w.key
    }
    deleted = {t.text[1:].split("=", 1)[0] for t in composed.verl_overrides if t.text.startswith("~")}
    sections |= {name for name in deleted if "." not in name}
    keys = list(composed.view.keys())
    findings: list[Finding] = []
    for section in sorted(sections):
        if section in composed.view:
            value = composed.view.get(section)
            prov = composed.view.prov(section)
            what = f"{section} is {value!r}, not a mapping of keys"
            source = prov.source if prov else Source(Layer.CLI)
            findings.append(_section_finding(section, what, value, source))
        elif section in deleted or not any(k.startswith(section + ".") for k in keys):
            gone = _deleted(composed, section, keys)
            if gone is not None:
                findings.append(_section_finding(section, gone, None, _deleting_source(composed, section)))
    return findings


def _deleted(composed: Composed, section: str, keys: list[str]) -> str | None:
    """Why ``section`` counts as deleted, or None when verl's own keys below it are still there.

    Deleting a config group (``~data``) drops verl's file for it; keys a user file or a later override sets
    below it do not bring verl's defaults back.
    """
    below = [k for k in keys if k.startswith(section + ".")]
    if not below:
        return f"{section} was deleted"
    layers = {p.source.layer for p in (composed.view.prov(k) for k in below) if p is not None}
    if Layer.VERL in layers:
        return None
    return f"{section} was deleted (the {len(below)} keys set below it afterwards do not restore verl's defaults)"


def _section_finding(section: str, what: str, value: object, source: Source) -> Finding:
    return Finding(
        "config-section",
        Severity.ERROR,
        (section,),
        f"{what}: verl reads keys below {section} and stops",
        f"drop the override of '{section}' (set keys below it instead, e.g. {section}.KEY=VALUE)",
        ((section, value, source),),
    )


def _deleting_source(composed: Composed, section: str) -> Source:
    for token in composed.verl_overrides:
        if token.text.lstrip("~").split("=", 1)[0] == section:
            return token.source
    return Source(Layer.CLI, reason=f"no key below {section} is left")

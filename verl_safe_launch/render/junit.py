"""JUnit XML for CI test reports, written as each script is audited: a test suite per script, a test case per
launch (failed when NO-GO), a skipped case for a script with no verl PPO launch."""

from __future__ import annotations

from typing import IO
from xml.sax.saxutils import escape as xml_escape
from xml.sax.saxutils import quoteattr

from verl_safe_launch.findings import Severity
from verl_safe_launch.preflight import LaunchAudit, ScriptAudit
from verl_safe_launch.render.report import render_finding

_INVALID = {c: None for c in range(32) if c not in (9, 10, 13)}


def _text(value: str) -> str:
    return xml_escape(value.translate(_INVALID))


def _attr(value: str) -> str:
    return quoteattr(value.translate(_INVALID))


class JunitWriter:
    """Streams one ``<testsuites>`` document: ``start``, ``script`` per audited script, ``end``."""

    def __init__(self, out: IO[str], *, fail_on: str = "error") -> None:
        self.out = out
        self.fail_on = fail_on
        """``error``: NO-GO launches fail; ``unverified``: UNVERIFIED ones too; ``warning``: also warnings."""

    def start(self) -> None:
        """The document's head."""
        self.out.write('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="verl-safe-launch audit">\n')

    def script(self, result: ScriptAudit) -> None:
        """One test suite: a case per launch, or one skipped or errored case for the script."""
        name = _attr(result.path)
        if result.skipped is not None or result.error is not None:
            skipped = result.skipped is not None
            why = result.skipped or (result.error.render() if result.error else "")
            inner = f"<skipped message={_attr(why)}/>" if skipped else f"<error message={_attr(why)}/>"
            self.out.write(
                f'  <testsuite name={name} tests="1" failures="0" errors="{0 if skipped else 1}" '
                f'skipped="{1 if skipped else 0}">\n'
                f"    <testcase classname={name} name={name}>{inner}</testcase>\n  </testsuite>\n"
            )
            return
        failed = [launch for launch in result.launches if self._fails(launch)]
        self.out.write(
            f'  <testsuite name={name} tests="{len(result.launches)}" failures="{len(failed)}" errors="0" '
            'skipped="0">\n'
        )
        for launch in result.launches:
            self.out.write(self._case(result, launch))
        self.out.write("  </testsuite>\n")

    def _fails(self, launch: LaunchAudit) -> bool:
        if launch.verdict == "no-go":
            return True
        if launch.verdict == "unverified" and self.fail_on in ("unverified", "warning"):
            return True
        return self.fail_on == "warning" and any(f.severity is Severity.WARNING for f in launch.findings)

    def _case(self, result: ScriptAudit, launch: LaunchAudit) -> str:
        head = f"    <testcase classname={_attr(result.path)} name={_attr(launch.launch.label)}"
        if not self._fails(launch):
            return head + "/>\n"
        shown = sorted(
            (f for f in launch.findings if f.severity is not Severity.INFO),
            key=lambda f: f.severity is not Severity.ERROR,
        )
        # the message names the first error; the body lists the warnings too
        first = shown[0] if shown else None
        message = f"{launch.verdict.upper()}: [{first.rule_id}] {first.message}" if first else launch.verdict
        body = "\n\n".join(render_finding(f) for f in shown)
        if launch.settle:
            body += f"\n\nto settle it: {launch.settle}"
        kind = "failure"
        return f"{head}>\n      <{kind} message={_attr(message)} type={_attr(launch.verdict)}>{_text(body)}</{kind}>\n    </testcase>\n"

    def end(self) -> None:
        """The document's foot."""
        self.out.write("</testsuites>\n")


__all__ = ["JunitWriter"]

"""Submit a pre-flighted run to an existing Ray cluster through its job API, and follow it to the end."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from verl_safe_launch.errors import EXIT_LAUNCH, EXIT_OK, UsageError
from verl_safe_launch.launch import NodeInfo, nodes_from_state, token_source, within

CONNECT_TIMEOUT_S = 15.0
JOB_FILE = "job.json"
JOB_CONFIG = "job.yaml"
T = TypeVar("T")


@dataclass(frozen=True)
class JobTarget:
    """The cluster's job API address and where it came from."""

    address: str
    source: str


def job_address(flag: str | None, env: Mapping[str, str], configured: object) -> JobTarget:
    """``--address``, then ``RAY_ADDRESS``, then ``ray_kwargs.ray_init.address``; it must be the dashboard's URL."""
    for value, source in (
        (flag, "--address"),
        (env.get("RAY_ADDRESS"), "RAY_ADDRESS"),
        (configured, "ray_kwargs.ray_init.address"),
    ):
        if value:
            text = str(value)
            if not text.startswith(("http://", "https://")):
                raise UsageError(
                    f"{source}={text} is not the address of a Ray job API",
                    where=source,
                    fix="give the dashboard's URL, e.g. --address http://HEAD:8265 (what 'ray job submit' uses)",
                )
            return JobTarget(text.rstrip("/"), source)
    raise UsageError(
        "no Ray cluster to submit to",
        where="--address / RAY_ADDRESS / ray_kwargs.ray_init.address",
        fix="pass --address http://HEAD:8265 (the cluster's dashboard)",
    )


def with_deadline(fn: Callable[[], T], seconds: float, target: JobTarget, what: str) -> T:
    """Run a blocking call with a deadline; unreachable or refusing clusters become one clear usage error."""
    try:
        return within(fn, seconds)
    except TimeoutError:
        raise _unreachable(target, what, f"no answer within {seconds:g} s") from None
    except Exception as exc:
        raise _unreachable(
            target, what, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        ) from None


def _unreachable(target: JobTarget, what: str, detail: str) -> UsageError:
    auth = "401" in detail or "403" in detail or "auth" in detail.lower()
    fix = (
        token_fix(os.environ)
        if auth
        else "check the address (the dashboard's URL, default port 8265) and that the cluster is up"
    )
    return UsageError(f"cannot {what} at {target.address} ({target.source}): {detail}", fix=fix)


AGENT_WAIT_S = 180.0
"""How long a job submission waits for the head's job agent, which registers a moment after the head is up."""
_NO_AGENT = "No available agent to submit job"


def submit_job(job_client: Any, target: JobTarget, wait_s: float = AGENT_WAIT_S, **job: Any) -> str:
    """Submit through Ray's job API; a head whose job agent has not registered yet (Ray answers "No available
    agent to submit job, please try again later") is asked again until ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return str(with_deadline(lambda: job_client.submit_job(**job), 60, target, "submit the job"))
        except UsageError as exc:
            if _NO_AGENT not in exc.what or time.monotonic() >= deadline:
                raise
            if not said:
                print(
                    f"the cluster's job agent is not up yet: asking again for up to {wait_s:g} s",
                    file=sys.stderr,
                )
                said = True
        time.sleep(2.0)


def token_fix(env: Mapping[str, str]) -> str:
    """What to do when the cluster refuses this process: name the token it sent, if any."""
    source = token_source(env)
    if source is None:
        return "the cluster wants a token: export RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=FILE)"
    return (
        f"the cluster refused the token from {source}: put the cluster's own token there (its head node's "
        "~/.ray/auth_token), or export RAY_AUTH_TOKEN=<the cluster's token>"
    )


def client(target: JobTarget) -> Any:
    """Ray's ``JobSubmissionClient`` for the target, connected within the deadline."""
    from ray.job_submission import JobSubmissionClient

    return with_deadline(
        lambda: JobSubmissionClient(target.address), CONNECT_TIMEOUT_S, target, "reach the job API"
    )


def cluster_nodes(target: JobTarget) -> list[NodeInfo]:
    """Every node of the cluster (alive or not) through Ray's state API."""
    from ray.util.state import list_nodes

    def read() -> list[Any]:
        return list(list_nodes(address=target.address, detail=True, raise_on_missing_output=False))

    return nodes_from_state(with_deadline(read, CONNECT_TIMEOUT_S, target, "list the cluster's nodes"))


def entrypoint(config_name: str, overrides: Sequence[str] = ()) -> str:
    """The job's driver: ``verl-safe-launch run --attach`` on the values the pre-flight judged (every value set
    above verl's defaults) plus the tokens a YAML cannot hold (config-group choices, deletions)."""
    words = ["python", "-m", "verl_safe_launch", "run", "--attach", "-c", config_name, "--run-dir", "run"]
    return shlex.join([*words, *overrides])


def job_runtime_env(run_dir: Path, env_vars: Mapping[str, str]) -> dict[str, Any]:
    """The run directory as the working dir, this package shipped with the job, and the run's env vars."""
    package = Path(__file__).resolve().parents[1]  # the verl_safe_launch package
    return {"working_dir": str(run_dir), "py_modules": [str(package)], "env_vars": dict(env_vars)}


def final_code(status: str) -> int:
    """The exit code of a finished job: 0 when it succeeded, 3 (the launch failed) otherwise."""
    return EXIT_OK if status == "SUCCEEDED" else EXIT_LAUNCH


TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


def follow(job_client: Any, job_id: str, stream: Callable[[str], None]) -> str:
    """Stream the job's logs until it ends; return its final status."""

    async def tail() -> None:
        async for chunk in job_client.tail_job_logs(job_id):
            stream(chunk)

    asyncio.run(tail())
    return status_name(job_client.get_job_status(job_id))


def status_name(status: object) -> str:
    """``SUCCEEDED`` for Ray's JobStatus (an enum of strings) or a plain string."""
    return str(getattr(status, "value", status)).rsplit(".", 1)[-1]


def wait(job_client: Any, job_id: str, say: Callable[[str], None], poll_s: float = 2.0) -> str:
    """Poll the job's status until it ends, saying each change; return the final status."""
    import time

    last = ""
    while True:
        status = status_name(job_client.get_job_status(job_id))
        if status != last:
            say(f"job {job_id}: {status}")
            last = status
        if status in TERMINAL:
            return status
        time.sleep(poll_s)

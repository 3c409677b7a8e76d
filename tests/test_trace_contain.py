"""``--trace`` runs a hostile script contained: nothing it starts survives, it sees no secret, output is capped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import ROOT, CliResult

from verl_safe_launch.shell import contain, trace_script, traced_launches

LAUNCH = "python3 -m verl.trainer.main_ppo"
BASE = 100_000 + os.getpid() % 100_000 * 10
"""Sleep durations no other process on this machine uses: how the test finds what the script left behind."""


@pytest.fixture(params=["namespaces", "session"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """Each test under the strongest containment here, and under the fallback every machine has."""
    if request.param == "namespaces" and not contain.containment().namespaces:
        pytest.skip("this machine refuses namespaces (unshare)")
    if request.param == "session":
        monkeypatch.setattr(contain, "containment", lambda: contain.Containment((), namespaces=False))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    yield request.param
    assert list((tmp_path / "tmp").iterdir()) == []  # the trace's directory is always removed


def alive(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (a sleep with an unusual duration)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in words:
            found.append(int(entry.name))
    return found


def write(tmp_path: Path, text: str) -> Path:
    script = tmp_path / "run.sh"
    script.write_text(text)
    return script


def test_every_process_the_script_started_is_killed(mode: str, tmp_path: Path) -> None:
    script = write(
        tmp_path,
        f"sleep {BASE + 1} &\nsetsid sleep {BASE + 2} &\nnohup sleep {BASE + 3} >/dev/null 2>&1 &\n"
        f"(setsid sh -c 'sleep {BASE + 4} &' &)\nsleep {BASE + 5} >&2 &\n"  # the last one holds the captured stderr
        f"{LAUNCH} a=1\n",
    )
    trace = trace_script(script, timeout=120)
    assert [call[-1] for call in trace.calls] == ["a=1"]  # returned when bash did, not at the timeout
    assert all(alive(str(BASE + i)) == [] for i in range(1, 6))


def test_a_script_that_kills_its_parent_leaves_nothing_behind(mode: str, tmp_path: Path) -> None:
    script = write(tmp_path, f"sleep {BASE + 6} &\n{LAUNCH} a=1\nkill -9 $PPID\nsleep 1\n")
    trace_script(script, timeout=60)
    assert alive(str(BASE + 6)) == []


def test_the_timeout_kills_everything_and_removes_the_directory(mode: str, tmp_path: Path) -> None:
    script = write(tmp_path, f"sleep {BASE + 7} &\nsetsid sleep {BASE + 8} &\nwhile :; do :; done\n")
    with pytest.raises(Exception, match="did not finish within 1 s under --trace"):
        trace_script(script, timeout=1)
    # The kill is sent before trace_script returns; a SIGKILLed process (or a PID namespace torn down after
    # its first process died) takes a moment to leave /proc on a loaded machine.
    deadline = time.monotonic() + 10
    while (alive(str(BASE + 7)) or alive(str(BASE + 8))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(str(BASE + 7)) == [] and alive(str(BASE + 8)) == []


def test_the_launchers_environment_is_out_of_reach(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VSL_TEST_SECRET", "s3cr3t-value")
    script = write(
        tmp_path,
        f"{LAUNCH} \"parent=$(tr '\\0' ' ' < /proc/$PPID/environ)\" \"self=$(env)\"\n"
        # every process's environment it can read, searched in the script: the whole text could pass the
        # kernel's 128 KiB limit for one argument on a busy machine, and the launch would then not run
        f"{LAUNCH} \"all=$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' ' ' | grep -o 's3cr3t' | head -n 1)\"\n",
    )
    first, everyone = trace_script(script).calls
    assert "s3cr3t" not in " ".join(first)
    # its parent holds only PATH; with fewer capabilities than its parent, the script cannot even read that
    assert first[-2] == "parent=" or first[-2].startswith("parent=PATH=")
    if mode == "namespaces":  # a fresh /proc: the launcher is not there to read
        assert "s3cr3t" not in " ".join(everyone)


def test_writes_outside_its_directory_are_refused_in_namespaces(mode: str, tmp_path: Path) -> None:
    outside = tmp_path / "escaped"
    script = write(tmp_path, f'echo x > {outside}\n: > inside\n{LAUNCH} "a=$(ls)"\n')
    (call,) = trace_script(script).calls
    assert call[-1] == "a=inside"
    assert outside.exists() == (mode == "session")


def test_output_is_capped_in_memory(tmp_path: Path) -> None:
    """400 MB on stdout and on stderr: the launcher's peak memory stays far below it, the tail is kept.

    The peak is VmHWM, this process's own: ru_maxrss would also count the pytest process it was spawned from
    (Linux carries the parent's high-water mark through vfork and exec).
    """
    script = write(
        tmp_path,
        "head -c 400000000 /dev/zero\nhead -c 400000000 /dev/zero | tr '\\0' x >&2\necho >&2; echo last >&2\n"
        f"{LAUNCH} a=1\n",
    )
    probe = (
        "import json, sys\nfrom verl_safe_launch.shell import trace_script\n"
        "t = trace_script(__import__('pathlib').Path(sys.argv[1]), timeout=300)\n"
        "print(json.dumps([len(t.stderr), t.stderr.splitlines()[-1], len(t.calls),"
        " [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", probe, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    kept, last, calls, peak_kib = json.loads(done.stdout)
    assert (kept, last, calls) == (contain.OUTPUT_TAIL, "last", 1)
    assert peak_kib < 150 * 1024


def test_a_file_the_script_writes_is_capped(mode: str, tmp_path: Path) -> None:
    script = write(tmp_path, f'head -c 100000000 /dev/zero > big\n{LAUNCH} "a=$(stat -c %s big)"\n')
    (call,) = trace_script(script).calls
    assert call[-1] == f"a={contain.FILE_LIMIT}"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e9", "-1", "0"])
def test_a_timeout_that_is_not_a_number_of_seconds_is_exit_2(
    value: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    script = write(tmp_path, f"{LAUNCH} a=1\n")
    result = cli("audit", "--trace", f"--timeout={value}", str(script))
    assert result.code == 2
    assert "is not a number of seconds from 0 to 3600" in result.err
    assert "Traceback" not in result.err


def test_audit_says_how_the_script_was_contained(cli: Callable[..., CliResult], tmp_path: Path) -> None:
    script = write(tmp_path, f"{LAUNCH} algorithm.adv_estimator=grpo\n")
    result = cli("audit", "--trace", str(script))
    box = contain.containment()
    assert f"{script}: contained: " in result.err
    assert ("namespaces (all killed at the end)" in result.err) == box.namespaces
    assert (
        traced_launches(str(script), trace_script(script).calls)[0].tokens[0].text
        == "algorithm.adv_estimator=grpo"
    )


def unprivileged_python() -> list[str] | None:
    """A command running Python as a user without root's right to read any process, able to import this
    package: this user's own Python, or (as root) the system Python under ``setpriv`` as nobody."""
    if os.geteuid() != 0:
        return [sys.executable]
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if setpriv is None or not os.access(python, os.X_OK):
        return None
    command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python]
    probe = subprocess.run(
        [*command, "-c", "import verl_safe_launch.shell"],
        env={"PYTHONPATH": str(ROOT)},
        capture_output=True,
        check=False,
    )
    return command if probe.returncode == 0 else None


def test_without_namespaces_the_launchers_environment_is_not_readable_through_proc() -> None:
    """The fallback: the script can find the launcher (its grandparent) in /proc, but not read its environment."""
    python = unprivileged_python()
    if python is None:
        pytest.skip("no unprivileged Python that can import this package")
    # In /tmp: the unprivileged user must reach the script, and a private TMPDIR's parents may be closed to it.
    folder = Path(tempfile.mkdtemp(prefix="vsl-test-", dir="/tmp"))
    try:
        folder.chmod(0o755)
        script = folder / "run.sh"
        script.write_text(
            'launcher=$(cut -d" " -f4 /proc/$PPID/stat)\n'
            f'{LAUNCH} "pid=$launcher" "env=$(tr "\\0" " " < /proc/$launcher/environ)"\n'
        )
        script.chmod(0o644)
        probe = (
            "import sys\nfrom pathlib import Path\nfrom verl_safe_launch.shell import contain, trace_script\n"
            "contain.containment = lambda: contain.Containment((), namespaces=False)\n"
            "print(trace_script(Path(sys.argv[1])).calls[0][-2:])\n"
        )
        env = {"PYTHONPATH": str(ROOT), "VSL_TEST_SECRET": "s3cr3t-value", "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [*python, "-c", probe, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(folder)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pid=" in done.stdout and "pid=0" not in done.stdout and "pid=')" not in done.stdout
    assert "s3cr3t" not in done.stdout


def start_launcher(script: Path, session: bool, marker: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``trace_script`` of ``script`` in a process of its own, returned once ``marker`` (a sleep) runs.

    Ctrl-C as in a terminal: Python's own SIGINT handler, even where this test runs with SIGINT ignored (a
    background job of a non-interactive shell inherits SIG_IGN, and Python then installs no handler).
    """
    probe = (
        "import signal, sys\nfrom pathlib import Path\nfrom verl_safe_launch.shell import contain, trace_script\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "if sys.argv[2] == '1':\n    contain.containment = lambda: contain.Containment((), namespaces=False)\n"
        "trace_script(Path(sys.argv[1]), timeout=600)\n"
    )
    command = [sys.executable, "-c", probe, str(script), "1" if session else "0"]
    launcher = subprocess.Popen(
        command, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stderr=subprocess.DEVNULL
    )
    for _ in range(500):
        if alive(marker):
            break
        time.sleep(0.02)
    if not alive(marker):
        launcher.kill()
        launcher.wait()
        pytest.fail("the script never started")
    return launcher


@pytest.mark.parametrize("session", [False, True], ids=["strongest", "session"])
def test_ctrl_c_on_the_launcher_kills_the_script_and_all_it_started(session: bool, tmp_path: Path) -> None:
    """The script has its own session (the terminal's Ctrl-C never reaches it): the launcher ends it on the way out."""
    script = write(
        tmp_path, f"sleep {BASE + 9} &\nsetsid sleep {BASE + 10} &\necho started >&2\nsleep {BASE + 11}\n"
    )
    launcher = start_launcher(script, session, str(BASE + 11), {})
    try:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
        left = [alive(str(BASE + i)) for i in (9, 10, 11)]
    finally:  # never hang the suite on a launcher that did not stop, nor leave its script behind
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in [p for i in (9, 10, 11) for p in alive(str(BASE + i))]:
            os.kill(pid, signal.SIGKILL)
    assert left == [[], [], []]


@pytest.mark.parametrize("session", [False, True], ids=["strongest", "session"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_launcher_killed_from_outside_takes_the_script_with_it(
    session: bool, signum: int, tmp_path: Path
) -> None:
    """``timeout``, ``kill`` or a scheduler ends the launcher: nothing the script started survives it (the kernel
    signals the first process when its parent dies), and after SIGTERM the trace's directory is gone too."""
    base = BASE + 20 + 10 * session + 5 * (signum == signal.SIGKILL)
    script = write(
        tmp_path, f"sleep {base} &\nsetsid sleep {base + 1} &\necho started >&2\nsleep {base + 2}\n"
    )
    temp = tmp_path / "tmp"
    temp.mkdir()
    launcher = start_launcher(script, session, str(base + 2), {"TMPDIR": str(temp)})
    try:
        launcher.send_signal(signum)
        code = launcher.wait(timeout=60)
        for _ in range(250):  # the kernel's signal and the first process's cleanup take a moment
            left = [alive(str(base + i)) for i in range(3)]
            if left == [[], [], []]:
                break
            time.sleep(0.02)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in [p for i in range(3) for p in alive(str(base + i))]:
            os.kill(pid, signal.SIGKILL)
    assert left == [[], [], []]
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM
        assert list(temp.iterdir()) == []
    else:
        for leftover in temp.iterdir():  # SIGKILL leaves the launcher no time to remove it
            shutil.rmtree(leftover)

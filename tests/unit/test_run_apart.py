"""proctools.run_apart: a short command (sbatch, its --test-only check) run in a session of its own, out of the
terminal's process group, stopped whole by a cancel, a deadline or an exception in the caller. Real processes: a
shell that leaves a grandchild holding the pipes, as an sbatch wrapper script would."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from orchestrator.node.proctools import Cancelled, alive, run_apart

# prints its pid and its grandchild's, then waits on the grandchild (which keeps stdout/stderr open)
WRAPPER = 'sleep 30 & echo "$$ $!" > "$1"; wait'


def _pids(path, deadline=5.0) -> list[int]:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            text = open(path).read().split()
            if len(text) == 2:
                return [int(t) for t in text]
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError("the wrapper never wrote its pids")


def _gone(pids, within=2.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


def test_output_exit_code_and_own_session():
    r = run_apart(["sh", "-c", 'cat /proc/$$/stat; echo oops >&2; exit 3'], timeout=10)
    pid, sid = int(r.stdout.split()[0]), int(r.stdout.rsplit(")", 1)[1].split()[3])  # (field 6: the session id)
    assert (r.returncode, r.stderr) == (3, "oops\n")
    assert sid == pid != os.getsid(0)  # a session of its own, led by the command


def test_cancel_stops_the_whole_session_within_a_poll(tmp_path):
    cancel = threading.Event()
    pidfile = tmp_path / "pids"
    at: list[float] = []

    def cancel_once_started() -> None:  # (both processes exist: the cancel has a whole session to stop)
        _pids(pidfile, 30)
        at.append(time.monotonic())
        cancel.set()
    threading.Thread(target=cancel_once_started, daemon=True).start()
    with pytest.raises(Cancelled):
        run_apart(["sh", "-c", WRAPPER, "sh", str(pidfile)], timeout=60, cancel=cancel)
    took = time.monotonic() - at[0]
    assert took < 1.5, took  # not the grandchild's 30 s: its open pipes do not keep the wait going
    assert _gone(_pids(pidfile)), "a process of the cancelled command is still alive"


def test_deadline_stops_the_whole_session(tmp_path):
    pidfile = tmp_path / "pids"
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_apart(["sh", "-c", WRAPPER, "sh", str(pidfile)], timeout=2)
    assert time.monotonic() - t0 < 4.0  # (not the grandchild's 30 s)
    assert _gone(_pids(pidfile))


def test_an_exception_in_the_caller_stops_it(tmp_path):
    """A KeyboardInterrupt raised while it waits (here from the cancel event's is_set) kills the command too."""
    pidfile = tmp_path / "pids"

    class Interrupting(threading.Event):
        def is_set(self):
            if os.path.exists(pidfile) and len(open(pidfile).read().split()) == 2:
                raise KeyboardInterrupt
            return False

    with pytest.raises(KeyboardInterrupt):
        run_apart(["sh", "-c", WRAPPER, "sh", str(pidfile)], timeout=60, cancel=Interrupting())
    assert _gone(_pids(pidfile))

"""The node agent's sweep after its launch ended (proctools.sweep_launch, issue #29): as its launch's child subreaper
the agent needs no /proc scan when no child is left, and still kills what the launch left behind, marker or not.

Each case runs in a process of its own (a subreaper is one for its life: never this test process), with real
processes: a launch in a session of its own whose child double-forks into yet another session and ignores TERM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.node.proctools import alive

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")

# The "agent": optionally a subreaper; starts the launch as the node agent does (own session), waits for it, sweeps,
# and reports how many /proc scans the sweep made and how long it took.
AGENT = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from orchestrator.node import proctools
    subreaper = sys.argv[1] == "1" and proctools.become_subreaper()
    scans = {"marked": 0, "group": 0, "children": 0}
    def counted(name, fn):
        def inner(*a, **k):
            scans[name] += 1
            return fn(*a, **k)
        return inner
    proctools.marked = counted("marked", proctools.marked)
    proctools.group_members = counted("group", proctools.group_members)
    proctools.children_apart = counted("children", proctools.children_apart)
    env = dict(os.environ, ORCHESTRATE_JOB_TOKEN=sys.argv[2])
    proc = subprocess.Popen([sys.executable, "-c", sys.argv[3]], env=env, start_new_session=True)
    proc.wait()
    t0 = time.monotonic()
    swept = proctools.sweep_launch(proc.pid, sys.argv[2], 1.0, subreaper)
    print(json.dumps({"subreaper": subreaper, "swept": swept, "scans": scans, "s": time.monotonic() - t0}))
""")

# The launch: forks a child that double-forks into a new session; the grandchild ignores TERM, drops the job's marker
# from its environment (exec with an environment of its own) and writes its pid; the launch exits 0 once it is written.
ESCAPE = textwrap.dedent("""
    import os, sys, time
    pidfile = {pidfile!r}
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # (not the pipes the test reads the agent's report from)
                os.dup2(null, fd)
            os.execve(sys.executable, [sys.executable, "-c",
                      "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "open({pidfile!r} + '.tmp', 'w').write(str(os.getpid())); "
                      "os.rename({pidfile!r} + '.tmp', {pidfile!r}); time.sleep(600)"],
                      {{"PATH": "/usr/bin:/bin"}})
        os._exit(0)
    os.wait()
    while not os.path.exists(pidfile):
        time.sleep(0.01)
""")

CLEAN = "import time; time.sleep(0.05)"


def sweep(subreaper: bool, launch: str, token: str) -> dict:
    r = subprocess.run([sys.executable, "-c", AGENT, "1" if subreaper else "0", token, launch],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_launch_that_left_nothing_is_swept_without_a_scan_of_proc():
    out = sweep(True, CLEAN, "t-clean")
    assert out["subreaper"] is True
    assert out["swept"] is False and out["scans"] == {"marked": 0, "group": 0, "children": 0}, out
    # without the subreaper the same launch costs the scans (what every agent did before)
    old = sweep(False, CLEAN, "t-clean-old")
    assert old["swept"] is True and old["scans"]["marked"] >= 1, old


def test_an_escaped_unmarked_term_ignoring_grandchild_in_a_new_session_is_killed(tmp_path):
    pidfile = tmp_path / "escaped.pid"
    out = sweep(True, ESCAPE.format(pidfile=str(pidfile)), "t-escape")
    pid = int(pidfile.read_text())
    try:
        assert out["swept"] is True and out["scans"]["children"] >= 1, out
        assert 0.9 <= out["s"] < 10, out  # it ignored TERM: KILLed once the grace (1 s) was up
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:  # (reaped by init once its subreaper exited)
            time.sleep(0.02)
        assert not alive(pid), f"pid {pid} outlived its launch's sweep"
    finally:
        if alive(pid):
            os.kill(pid, 9)


def test_without_the_subreaper_the_unmarked_escapee_is_not_found(tmp_path):
    """The case the subreaper exists for: the marker scan alone cannot see a process that dropped the marker."""
    pidfile = tmp_path / "escaped.pid"
    sweep(False, ESCAPE.format(pidfile=str(pidfile)), "t-escape-old")
    pid = int(pidfile.read_text())
    try:
        assert alive(pid)
    finally:
        os.kill(pid, 9)

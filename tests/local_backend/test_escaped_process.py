"""Nothing of a job outlives it, also a process that escaped every trace of it (issue #29): a rank whose child
double-forks into a session of its own, drops the job's marker from its environment (ORCHESTRATE_JOB_TOKEN, which the
agent's marker sweep looks for) and ignores SIGTERM. The real local backend, `accelerate launch` and node agent: the
agent, its launch's child subreaper, finds it as its own child once the launch has ended and KILLs it after the
grace."""

from __future__ import annotations

import os
import sys
import time

import pytest

from helpers import cli
from orchestrator.node.proctools import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")

SCRIPT = '''
import os, sys, time
pidfile = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execve(sys.executable, [sys.executable, "-c",
                  "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                  "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)", pidfile],
                  {"PATH": "/usr/bin:/bin"})
    os._exit(0)
os.wait()
while not os.path.exists(pidfile):
    time.sleep(0.01)
print("ESCAPED", open(pidfile).read(), flush=True)
'''


def test_an_unmarked_term_ignoring_process_in_a_new_session_does_not_outlive_its_job(tmp_path):
    import yaml
    script, pidfile = tmp_path / "escape.py", tmp_path / "escaped.pid"
    script.write_text(SCRIPT)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(script), "args": [str(pidfile)]},
                                   "launch": {"procs_per_node": 1}}))
    r = cli("submit", job, cwd=tmp_path, timeout=300)
    assert pidfile.exists(), r.stdout + r.stderr
    pid = int(pidfile.read_text())
    try:
        assert r.returncode == 0, r.stdout + r.stderr  # the job itself completed
        assert "ESCAPED" in r.stdout + r.stderr
        deadline = time.monotonic() + 10  # (gone when the submit returns: the agent's sweep ended before its exit)
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), f"pid {pid} outlived its job"
    finally:
        if alive(pid):
            os.kill(pid, 9)

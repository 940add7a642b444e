"""AgentTask's wait for its node agent (real child processes): woken at once when the agent exits, bounded by
a timeout (the checkpoint handler's save wait), signal deaths mapped to 128+N as SLURM reports them."""

import signal
import subprocess
import time

from launchers.slurm.task import AgentTask


def _task_with(argv: list[str]) -> AgentTask:
    t = AgentTask("/nonexistent", "python", max_restarts=1)
    proc = subprocess.Popen(argv)
    proc.returncode = 0  # reaped by the task, not by Popen
    t._pid = proc.pid
    return t


def test_wait_returns_when_the_agent_exits_without_polling_delay():
    t = _task_with(["sleep", "0.3"])
    t0 = time.monotonic()
    assert t._wait(None) == 0
    took = time.monotonic() - t0
    assert 0.25 < took < 0.3 + 0.04, took
    assert t._wait(None) == 0  # reaped once, remembered


def test_wait_times_out_and_reports_a_signal_death_as_128_plus_n():
    t = _task_with(["sleep", "30"])
    t0 = time.monotonic()
    assert t._wait(0.2) is None
    assert 0.15 < time.monotonic() - t0 < 0.5
    import os
    os.kill(t._pid, signal.SIGKILL)
    assert t._wait(5) == 128 + signal.SIGKILL


def test_wait_exit_code_passes_through():
    t = _task_with(["sh", "-c", "exit 7"])
    assert t._wait(5) == 7

"""A recorded pid whose process has ended may belong to an unrelated process later: what orchestrate signals from a
record (a node's agent and process groups from agent.json, a job's supervisor from supervisors/<job>.pid) is checked
against the start time recorded with it (proctools.same_process / group_is_ours). Real processes stand in for the
"unrelated" ones: a record that names a live process with another start time must leave it alone."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import spawn
from orchestrator.node.ops import kill_node, node_status
from orchestrator.node.proctools import alive, process_start_time, same_process
from orchestrator.node.rundir import AgentRecord, RunDir


@pytest.fixture
def bystander():
    """An unrelated process in a session of its own (pid == pgid), as one that got a recorded pid later would be."""
    p = spawn(["sleep", "120"], group=False, start_new_session=True)
    deadline = time.monotonic() + 5
    while process_start_time(p.pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def test_same_process_tells_a_reused_pid_apart(bystander):
    start = process_start_time(bystander.pid)
    assert same_process(bystander.pid, start) and same_process(bystander.pid, None)
    assert not same_process(bystander.pid, start - 60)  # the recorded process started a minute earlier: not this one
    bystander.kill()
    bystander.wait()
    assert not same_process(bystander.pid, start)


def _record(tmp_path, pid: int, start: float) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.write_agent(AgentRecord(node_rank=0, host="h", agent_pid=pid, agent_pgid=pid, pid=pid, pgid=pid,
                               agent_proc_start=start, proc_start=start, token=""))
    return rd


def test_kill_node_spares_a_process_that_reused_the_recorded_pids(tmp_path, bystander):
    start = process_start_time(bystander.pid)
    rd = _record(tmp_path, bystander.pid, start - 60)  # our agent and launch ended long ago; the ids were handed out
    assert rd.agent(0).groups() == []
    assert node_status(rd, None)[0]["agent_alive"] is False  # status does not take it for the job's agent
    kill_node(rd, None, grace=0.5)
    time.sleep(0.2)
    assert alive(bystander.pid), "an unrelated process was signalled"
    rd = _record(tmp_path, bystander.pid, start)  # the record's own processes: they are killed
    assert rd.agent(0).groups() == [bystander.pid, bystander.pid]
    assert node_status(rd, None)[0]["agent_alive"] is True
    kill_node(rd, None, grace=0.5)
    assert bystander.wait(timeout=5) in (-signal.SIGTERM, -signal.SIGKILL)


def test_a_supervisor_pid_file_naming_a_reused_pid_is_no_supervisor(tmp_path, monkeypatch, bystander):
    from orchestrator.detach import forget_self, live_supervisor, record_self
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    sup = tmp_path / "home" / "supervisors"
    sup.mkdir(parents=True)
    start = process_start_time(bystander.pid)
    (sup / "j1.pid").write_text(f"{bystander.pid} {start - 60:.3f}\n")
    assert live_supervisor("j1") is None
    (sup / "j1.pid").write_text(f"{bystander.pid} {start:.3f}\n")
    assert live_supervisor("j1") == bystander.pid
    (sup / "j1.pid").write_text(f"{bystander.pid}\n")  # written before start times were recorded: alive decides
    assert live_supervisor("j1") == bystander.pid
    record_self("j2")  # this process: pid and start time; forget_self removes only its own file
    assert (sup / "j2.pid").read_text().split()[0] == str(os.getpid())
    assert abs(float((sup / "j2.pid").read_text().split()[1]) - process_start_time()) < 1.0
    forget_self("j2")
    assert not (sup / "j2.pid").exists()

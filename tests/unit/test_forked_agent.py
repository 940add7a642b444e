"""The local backend forks its node agents from the submitting process when it is single-threaded
(launchers.local.ForkedAgent): the child is the real agent (`orchestrator.node.agent.main`) in a session of its own,
its output on the pipe, its exit code returned, nothing of the parent's buffered output written twice. A job of real
agents forked this way runs in every local-backend test; these check the process contract itself."""

from __future__ import annotations

import signal
import sys
import threading
import time

from launchers.local import AGENT_COMM, ForkedAgent, forkable
from orchestrator.node.agent import MODULE, agent_argv


def test_only_this_interpreters_agent_is_forked():
    assert forkable(agent_argv(sys.executable, "/r", node_rank=0))
    assert not forkable(agent_argv("/opt/other/bin/python", "/r", node_rank=0))  # (the plan's own interpreter)
    assert not forkable((sys.executable, "-m", "some.other.module", "/r"))
    assert MODULE == "orchestrator.node"


def test_a_forked_agent_runs_the_real_agent_in_a_session_of_its_own(tmp_path, capfd):
    sys.stdout.write("BUFFERED-IN-THE-PARENT")  # not flushed yet: the child must not write it again
    agent = ForkedAgent([str(tmp_path), "--status"])
    out = agent.stdout.read().decode()
    assert agent.wait() == 0 and agent.poll() == 0 and agent.returncode == 0
    assert out == "", out  # an empty run dir: no node to report; nothing of the parent's buffer either
    sys.stdout.flush()
    assert capfd.readouterr().out.count("BUFFERED-IN-THE-PARENT") == 1


def test_its_exit_code_output_and_stdin_are_the_agents(tmp_path):
    agent = ForkedAgent([str(tmp_path), "--no-such-flag"])  # argparse: usage on stderr (the pipe), exit 2
    out = agent.stdout.read().decode()
    assert agent.wait() == 2 and "unrecognized arguments: --no-such-flag" in out, out
    # a probe waits for its go on stdin: /dev/null, EOF at once, so it exits 0 having started nothing
    agent = ForkedAgent([str(tmp_path), "--probe", "{}"])
    assert "ORCHESTRATE_PROBE" in agent.stdout.read().decode()
    with open(f"/proc/{agent.pid}/comm") as f:  # (a zombie until reaped: its name is still readable)
        assert f.read().strip() == AGENT_COMM.decode()
    assert agent.wait() == 0


def test_wait_and_poll_from_two_threads_agree(tmp_path):
    agent = ForkedAgent([str(tmp_path), "--status"])
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(agent.wait()))
    t.start()
    deadline = time.monotonic() + 30
    while agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    t.join(30)
    assert got == [0] and agent.poll() == 0
    agent.send_signal(signal.SIGTERM)  # (gone: nothing is signalled, no error)

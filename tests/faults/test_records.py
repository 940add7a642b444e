"""Records that agree with what happened (issue #28 item 7), on the local backend with real node agents and a real
`accelerate launch` of 2 nodes, through the CLI as a user runs it:

- a node agent SIGKILLed: `status` shows an honest exit code (137/SIGKILL: 128 + the signal, never `exit 9` as if the
  training had exited 9), the killed node `failed` with that code and the healthy one `stopped` (torn down), as the
  cause says;
- ORCHESTRATE_HOME filling up while the job runs (a small tmpfs, filled to the last byte once the ranks step): no node
  agent traces back, each node's exit record is there (room kept for it), the end recorded is the real one
  (COMPLETED, exit 0, both nodes `done`), never "lost: agent gone without an exit record";
- the same with no room kept (the disk full to the last byte, the kept room taken too): each agent prints its exit
  record as one `ORCHESTRATE_EXIT {json}` line of its output, which the supervisor reads; the store cannot take the end
  either, the submit says so and keeps trying (END_RETRY_S), and once there is space again it records the real end.

Mounting a tmpfs needs root: without it the full-disk test skips, except under CI=true, where that is a failure."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from helpers import Submit, fill, small_tmpfs, wait_gone, wait_until
from helpers import cli_status as _status
from orchestrator.node.proctools import marked
from orchestrator.node.rundir import RESERVE, RunDir
from orchestrator.store import JobStore

REPO = Path(__file__).resolve().parents[2]
BEAT_LOOP = Path(__file__).with_name("beat_loop.py")

pytestmark = pytest.mark.health


def _job(tmp: Path, steps: int, pause: float) -> Path:
    p = tmp / "beats.yaml"
    p.write_text(yaml.safe_dump({"run": {"script": str(BEAT_LOOP), "args": [str(steps), str(pause)]},
                                 "health": {"stall_timeout": 60, "startup_timeout": 120, "max_restarts": 0}}))
    return p


def test_an_agent_killed_by_sigkill_is_shown_as_killed_and_the_node_table_agrees(tmp_path, job_guard):
    sub = Submit([_job(tmp_path, 100000, 0.1), "--nodes", "2"], tmp_path, {}, job_guard)
    job = sub.job_id()
    rd = RunDir(JobStore().get(job).run_dir)
    wait_until(lambda: len(rd.agents()) == 2 and (rd.furthest_step() or 0) >= 3, 180, 0.2, "both nodes stepping")
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    os.kill(rd.agent(1).agent_pid, signal.SIGKILL)
    assert sub.wait(60) == 1, sub.text[-3000:]
    wait_gone(lambda: [p for t in tokens for p in marked(t)], 20)
    st, text = _status(job)
    print(text)
    assert (st["state"], st["exit_code"], st["exit_signal"]) == ("FAILED", 137, "SIGKILL"), st
    assert "node agent ended (signal SIGKILL)" in st["root_cause"], st["root_cause"]
    assert "state    FAILED  (exit 137/SIGKILL)" in text and "(exit 9)" not in text, text
    nodes = {n["node"]: n for n in st["nodes"]}
    assert (nodes[1]["end"], nodes[1]["exit_code"], nodes[1]["signal"]) == ("failed", 137, "SIGKILL"), nodes[1]
    assert nodes[0]["end"] == "stopped", nodes[0]  # torn down because node 1 failed, not a node that finished
    assert "stopped" in text.split("NODE", 1)[1].splitlines()[1], text


@pytest.fixture
def small_home(tmp_path):
    """ORCHESTRATE_HOME's filesystem: a 16 MiB tmpfs (unmounted at the end, pass or fail)."""
    yield from small_tmpfs(tmp_path / "fs", "16m")


def _stepping_on(small_home: Path, tmp_path: Path, job_guard):
    """A 2-node job of 60 steps whose ORCHESTRATE_HOME is on the small tmpfs, once both nodes step: (the submit, its
    job id, run dir, launch tokens, environment)."""
    home = small_home / "home"
    env = {"ORCHESTRATE_HOME": str(home)}
    job_guard.home(home)
    sub = Submit([_job(tmp_path, 60, 0.1), "--nodes", "2"], tmp_path, env, job_guard)
    job = sub.job_id()
    rd = RunDir(home / "runs" / job)
    wait_until(lambda: len(rd.agents()) == 2 and (rd.furthest_step() or 0) >= 3, 180, 0.1, "both nodes stepping")
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    return sub, job, rd, tokens, env


def test_a_full_orchestrate_home_mid_run_keeps_the_real_end(small_home, tmp_path, job_guard):
    sub, job, rd, tokens, env = _stepping_on(small_home, tmp_path, job_guard)
    filler = fill(small_home)
    full_at = rd.furthest_step()
    # the job goes on to its end; the submit tries to record it (the store may be full: it says so and tries again)
    deadline = time.monotonic() + 120
    while sub.proc.poll() is None and time.monotonic() < deadline and "cannot record it" not in sub.text:
        time.sleep(0.2)
    wait_gone(lambda: [p for t in tokens for p in marked(t)], 60)
    filler.unlink()  # space again
    rc = sub.wait(120)
    print("\n".join(ln for ln in sub.text.splitlines() if "space" in ln or "orchestrate" in ln))
    print(f"disk full at step {full_at}")
    _ended_completed(sub, rc, job, env)
    for r in (0, 1):  # the room kept for each exit record took it, however full the disk was
        rec = rd.exit(r)
        assert rec is not None and rec.returncode == 0 and not rec.stop_reason, (r, rec)


def _ended_completed(sub: Submit, rc: int, job: str, env: dict) -> None:
    """The job ran to its end with no traceback of ours, and `status` says COMPLETED with both nodes done."""
    # no traceback of ours (torchrun's own exit-barrier noise when its peer's store closes first is not ours)
    ours = [ln for ln in sub.text.splitlines() if "orchestrator/" in ln and 'File "' in ln]
    assert not ours, "\n".join(ours)
    assert rc == 0, sub.text[-3000:]
    assert "BEAT_LOOP_DONE" in sub.text, "the job did not run to its end"
    st, text = _status(job, env)
    print(text)
    assert (st["state"], st["exit_code"]) == ("COMPLETED", 0), st
    assert [n["end"] for n in st["nodes"]] == ["done", "done"], st["nodes"]
    assert "lost" not in text and "without an exit record" not in text, text


def test_with_no_room_left_the_agents_print_their_exit_records_and_the_store_is_retried(small_home, tmp_path,
                                                                                         job_guard):
    sub, job, rd, tokens, env = _stepping_on(small_home, tmp_path, job_guard)
    fillers = [fill(small_home)]
    for r in (0, 1):  # the room each agent kept for its exit record goes too, and is filled at once
        (rd.node_dir(r) / RESERVE).unlink()
    fillers.append(fill(small_home, "filler2"))
    # the job runs to its end; the store cannot take it: the submit says so and tries again (END_RETRY_S, 60 s)
    wait_until(lambda: "cannot record it" in sub.text or sub.proc.poll() is not None, 150, 0.2, "the store retry")
    assert sub.proc.poll() is None, sub.text[-3000:]
    wait_gone(lambda: [p for t in tokens for p in marked(t)], 60)
    for f in fillers:
        f.unlink()  # space again, within the retry
    rc = sub.wait(90)
    print("\n".join(ln for ln in sub.text.splitlines() if "record" in ln or "space" in ln))
    _ended_completed(sub, rc, job, env)
    assert sub.text.count("exit record could not be written") >= 2, sub.text[-3000:]  # each agent said so, once
    assert "ORCHESTRATE_EXIT" not in sub.text, "the printed record is read, not shown as output"
    assert all(rd.exit(r) is None for r in (0, 1))  # no file: the records reached the supervisor as lines


def test_an_agent_killed_before_its_launch_leaves_no_earlier_attempts_records_behind(tmp_path):
    """Records are per attempt: a restarted node's agent that dies before it starts anything (SIGKILL while it waits
    in its pre-flight, as a QUEUED or starting SSH job's agents do) must not leave the previous attempt's exit.json and
    agent.json in its run dir, where the supervisor would read them as this attempt's (a rank pid killed long before,
    a crash instead of a lost host, the previous attempt's agent pid and pgid)."""
    import json
    import subprocess
    import sys
    from orchestrator.node.rundir import AgentRecord, ExitRecord
    rd = RunDir(tmp_path / "run")
    rd.write_agent(AgentRecord(node_rank=1, host="h", agent_pid=4242, pgid=4243))
    rd.write_exit(1, ExitRecord(returncode=137, rank_death="rank 1 (pid 4244) died of SIGKILL (exit -9)"))
    rd.write_exit(0, ExitRecord(returncode=0))  # another node's record is not this agent's to drop
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.node", str(rd.root), "--node-rank", "1", "--probe",
                          json.dumps({"workdir": str(tmp_path / "wd")})], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().startswith("ORCHESTRATE_PROBE "), "the agent's pre-flight answer"
    finally:
        p.kill()
        p.wait()
    assert rd.exit(1) is None and rd.agent(1) is None, (rd.exit(1), rd.agent(1))
    assert rd.exit(0) is not None

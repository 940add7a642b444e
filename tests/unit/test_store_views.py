"""The job store under concurrent orchestrate processes, and the operator views (golden text)."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.store import JobStore
from orchestrator.cli.views import jobs_text, sparkline, status_text
from view_helpers import JOB_ROWS, status_fixture

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import sys, time
sys.path.insert(0, {repo!r})
from orchestrator.store import JobStore
s = JobStore()
i = int(sys.argv[1])
jid = f"job-{{i:02d}}"
s.create(job_id=jid, recipe="r.yaml", recipe_digest="d", cluster="c", backend="local", nodes=2, world_size=2,
         run_dir="/tmp/x")
for state in ("RUNNING", "RESTARTING", "RUNNING", "COMPLETED"):
    s.update(jid, state, detail=f"{{state}} by {{i}}")
    assert s.get(jid).state == state
    s.list(50)
print("ok", i)
"""


@pytest.mark.health
def test_twenty_concurrent_processes_lose_nothing(tmp_path):
    env = dict(os.environ, ORCHESTRATE_HOME=str(tmp_path))
    code = WORKER.format(repo=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(20)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs if o[1]]
    store = JobStore(tmp_path / "jobs.db")
    jobs = store.list(100)
    assert len(jobs) == 20 and {j.state for j in jobs} == {"COMPLETED"}
    for j in jobs:
        assert [e["state"] for e in store.events(j.id)] == ["PENDING", "RUNNING", "RESTARTING", "RUNNING", "COMPLETED"]
    import sqlite3
    assert sqlite3.connect(tmp_path / "jobs.db").execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert (tmp_path / "jobs.db").stat().st_mode & 0o077 == 0


def test_sparkline():
    assert sparkline([3, 2, 1]) == "█▅▁"
    assert sparkline([1, 1]) == "▁▁"
    assert len(sparkline(list(range(100)), width=10)) == 10
    assert sparkline([]) == ""


@pytest.mark.health
def test_status_text_golden(tmp_path):
    from orchestrator.cli.views import job_status
    st = job_status(status_fixture(tmp_path), now=1010.0)
    text = status_text(st).replace(str(tmp_path), "TMP")
    assert text == """job      sft-1
state    FAILED  (exit 1)
backend  ssh  ssh://sft-1
cluster  lab
restarts 1
run dir  TMP/run
cause    node 1 (gpu02) failed: signal SIGKILL
slow     rank 1 on gpu02: 2.5x the others' forward time per step (attempt 0, step 3, warn)

NODE  HOST                 RANKS     END       EXIT        NOTE
0     gpu01                0-0       -         -
1     gpu02                1-1       stopped   137/SIGKILL signal SIGTERM

RANK  HOST                       STEP     LOSS   BEAT  FWD/STEP  LOSS CURVE
0     gpu01                      5/10   3.5000     5s    20.0ms  █▆▅▃▁
1     gpu02                      3/10   4.4000     7s SLOW 50.0ms  █▅▁"""
    assert st["ranks"][1]["heartbeat_age_s"] == 7.0


@pytest.mark.health
def test_jobs_text_golden():
    assert jobs_text(JOB_ROWS, now=1090.0) == (
        "JOB                                          STATE      BACKEND NODES    STEP    AGE\n"
        "sft_tiny-20261122-0400-ab12                  RUNNING    local       2      12    90s\n"
        "dpo-20261122-0300-cd34                       COMPLETED  slurm       4       -    18m")
    assert jobs_text([]) == "no jobs yet"


@pytest.mark.health
def test_plot_png(tmp_path):
    from orchestrator.cli.plot import plot_job
    rec = status_fixture(tmp_path)
    png, drew = plot_job(rec["run_dir"], str(tmp_path / "p.png"), "sft-1")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert drew == "rank(s) 0-1 of 2"


@pytest.mark.health
def test_hang_culprit_prefers_a_stopped_rank_even_under_its_limit():
    from orchestrator.core.health import HealthMonitor, HealthSpec
    m = HealthMonitor(HealthSpec(stall_timeout=8), world_size=2, started=0.0)
    m.feed({"rank": 0, "host": "a", "step": 5, "event": "step"}, received=100.0)
    m.feed({"rank": 1, "host": "b", "step": 5, "event": "step"}, received=101.0)  # forwarded a moment later
    stalls = m.stalls(108.5)
    assert [s.rank for s in stalls] == [0]
    assert m.culprit(stalls, {1: 4242}, 108.5).startswith("rank 1 on b hung: no heartbeat for 8s during training")
    assert "(process 4242 is stopped); ranks 0 also silent" in m.culprit(stalls, {1: 4242}, 108.5)
    assert m.culprit(stalls, {}, 108.5).startswith("rank 0 on a hung")


def test_completed_text():
    from orchestrator.cli.views import completed_text
    assert completed_text("j", {}) == "job j COMPLETED"
    assert completed_text("j", {"first_loss": 6.0, "final_loss": 2.25, "global_step": 10, "output_dir": "/o",
                                "last_checkpoint": "/o/checkpoint-10"}) == \
        "job j COMPLETED: loss 6.000 -> 2.250 over 10 steps; checkpoint: /o/checkpoint-10"
    assert completed_text("j", {"final_loss": None, "output_dir": "/o"}) == "job j COMPLETED; checkpoint: /o"


@pytest.mark.health
def test_a_hang_of_thousands_of_ranks_names_the_longest_silent_and_counts_the_rest():
    from orchestrator.core.health import SILENT_LISTED, HealthMonitor, HealthSpec
    m = HealthMonitor(HealthSpec(stall_timeout=8), world_size=8192, started=0.0)
    for r in range(8192):
        m.feed({"rank": r, "host": f"n{r // 8}", "step": 5, "event": "step"}, received=100.0 + r / 10000)
    text = m.culprit(m.stalls(200.0), {}, 200.0)
    assert text.startswith("rank 0 on n0 hung: no heartbeat for 100s during training"), text[:200]
    listed = text.split("; ranks ", 1)[1]
    named = ", ".join(str(r) for r in range(1, SILENT_LISTED + 1))
    assert listed == f"{named}, {8191 - SILENT_LISTED:,} more also silent", listed
    assert len(text) < 300, len(text)

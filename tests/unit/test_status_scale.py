"""Operator commands on a 1,024-node x 8-rank job (issue #29): `status`, `status --json` and `ls` cost what the job's
size costs, not what its history does, and a big job's `status` shows the ranks worth a look with a summary line.

The job is the one bench/bench_status_scale.py builds (the real planner's plan for an SSH cluster of 1,024 hosts, the
real store, the RunDir writers the agents use, heartbeat files in the hooks' format); the commands run as a user runs
them, the CLI in a fresh process. Their CPU time is asserted (the wall time on a loaded 2-core CI machine is not the
command's own); bench/results/status_scale.json has the wall times on this machine.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import OFFLINE_ENV, PYTHON, REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_status_scale

from orchestrator.cli.views import SHOWN, notable_ranks
from orchestrator.core.health import MAX_LOSSES, HealthMonitor, HealthSpec


def _cpu_of(home: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([PYTHON, "-m", "orchestrator.cli", *args], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **OFFLINE_ENV, "ORCHESTRATE_HOME": str(home)}, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0, out.stderr[-2000:]
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


@pytest.fixture(scope="module")
def big_job(tmp_path_factory):
    home, work = tmp_path_factory.mktemp("big_home"), tmp_path_factory.mktemp("big_work")
    job = bench_status_scale.make_job(home, work, 1024, 8, steps=60, log_lines=50, state="RUNNING")
    # one rank behind, one node stopped with a failure: what a big job's status must still show
    hb = home / "runs" / job / "heartbeats" / "rank5000.jsonl"
    lines = hb.read_text().splitlines()
    hb.write_text("\n".join(lines[:30]) + "\n")
    from orchestrator.node.rundir import ExitRecord, RunDir
    RunDir(home / "runs" / job).write_exit(700, ExitRecord(returncode=137, time=0.0, launch_returncode=137,
                                                           stop_reason="", host="10.77.2.201"))
    return home, job


def test_status_of_1024_nodes_costs_its_size_not_its_history(big_job):
    home, job = big_job
    # startup alone (imports, the store) is ~0.15 CPU-s here; reading 8,192 whole heartbeat files was ~15 s
    cpu, out = _cpu_of(home, "status", job, "--color", "never")
    assert cpu < 0.8, cpu
    lines = out.stdout.splitlines()
    summary = next(ln for ln in lines if ln.startswith("ranks "))
    assert "8192 ranks: step 30-60" in summary and "(every rank: status --json)" in summary
    nodes = next(ln for ln in lines if ln.startswith("nodes "))
    assert "1024 nodes: 1 failed, 1023 running" in nodes
    rows = [ln.split() for ln in lines if ln[:1].isdigit()]
    ranks_shown = {int(r[0]) for r in rows if len(r) > 4 and "/" in r[2]}
    assert {0, 5000} <= ranks_shown and len(ranks_shown) <= SHOWN
    assert any(r[:5] == ["700", "10.77.2.201", "5600-5607", "failed", "137/SIGKILL"] for r in rows)  # its row

    cpu, out = _cpu_of(home, "status", job, "--json")
    assert cpu < 0.8, cpu
    st = json.loads(out.stdout)
    assert len(st["ranks"]) == 8192 and len(st["nodes"]) == 1024
    assert {r["rank"]: r["step"] for r in st["ranks"]}[5000] == 30

    cpu, out = _cpu_of(home, "ls")
    assert cpu < 0.6, cpu
    assert f"{job[:44]}" in out.stdout and " 60 " in out.stdout


def test_a_small_job_shows_every_rank(tmp_path):
    st = {"nodes": [{"node": 0, "host": "h", "ranks": list(range(SHOWN)), "exit_code": None, "stop_reason": None}],
          "ranks": [{"rank": r, "host": "h", "step": 1, "max_steps": None, "loss": 1.0, "heartbeat_age_s": 1.0,
                     "event": "step"} for r in range(SHOWN)], "state": "RUNNING", "stragglers": []}
    rows, summary = notable_ranks(st)
    assert len(rows) == SHOWN and summary is None


def test_loss_history_is_bounded_and_keeps_its_ends():
    mon = HealthMonitor(HealthSpec(), 1, 0.0)
    for step in range(1, 10_001):
        mon.feed({"rank": 0, "t": step, "step": step, "loss": 10_000.0 - step, "event": "step"}, float(step))
    st = mon.snapshot()[0]
    assert len(st.losses) <= MAX_LOSSES
    curve = st.loss_curve()
    assert curve[0] == (1, 9999.0) and curve[-1] == (10_000, 0.0)
    steps = [s for s, _ in curve]  # evenly over the whole run: no gap wider than the stride
    assert steps == sorted(steps) and max(b - a for a, b in zip(steps, steps[1:], strict=False)) <= st.loss_stride
    assert st.loss_stride <= 2 * 10_000 // MAX_LOSSES

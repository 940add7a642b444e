"""The monitor inside a SLURM allocation (orchestrator.node.hangwatch, `Agent.monitor`) at issue #29's scale: a node's
poll reads its own ranks' heartbeat files only, the same number whatever the job's size, and the job's hang is still
found and named as a job-wide view names it: the node holding a stopped rank at once, any other node (after leaving
that node its time) from one bounded read of every rank's latest records."""

from __future__ import annotations

import builtins
import json
import os
import sys
from pathlib import Path

import pytest

from orchestrator.node.hangwatch import DEFER_HANG_S, HangWatch
from orchestrator.node.rundir import RunDir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_scale import plan_for  # (a real LaunchPlan of N nodes x R ranks)

PPN = 8
T0 = 1_000_000.0
STALL = 300.0  # plan_for's health.stall_timeout


class Opened:
    """Heartbeat files opened, and directory listings made, while installed."""

    def __init__(self, monkeypatch):
        self.files: list[str] = []
        self.listings = 0
        real_open, real_scandir = builtins.open, os.scandir

        def counted_open(file, *a, **kw):
            if "heartbeats" in str(file):
                self.files.append(Path(file).name)
            return real_open(file, *a, **kw)

        def counted_scandir(*a, **kw):
            self.listings += 1
            return real_scandir(*a, **kw)
        monkeypatch.setattr(builtins, "open", counted_open)
        monkeypatch.setattr(os, "scandir", counted_scandir)


def _beat(hb: Path, rank: int, step: int, t: float) -> None:
    with open(hb / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"t": t, "rank": rank, "host": f"node{rank // PPN:04d}", "step": step, "event": "step",
                            "loss": 1.0}) + "\n")


def _job(tmp_path: Path, nodes: int):
    plan = plan_for(nodes, PPN, str(tmp_path))
    rd = RunDir(tmp_path)
    rd.heartbeats.mkdir(parents=True, exist_ok=True)
    for g in range(nodes * PPN):  # an earlier attempt's records: not this attempt's health
        _beat(rd.heartbeats, g, 99, T0 - 500)
    return plan, rd


@pytest.mark.parametrize("nodes", [2, 256])
def test_a_poll_reads_this_nodes_ranks_only_whatever_the_jobs_size(tmp_path, monkeypatch, nodes):
    plan, rd = _job(tmp_path, nodes)
    watch = HangWatch(rd, plan, 1, started=T0)
    for g in range(nodes * PPN):
        _beat(rd.heartbeats, g, 1, T0 + 1)
    opened = Opened(monkeypatch)
    for i in range(3):
        assert watch.poll(T0 + 2 + i) == []
    # 8 files a poll at 16 ranks and at 2,048 (every agent reading every rank's file: 2,048 a poll on each of 256 nodes)
    assert sorted(opened.files) == sorted([f"rank{g}.jsonl" for g in range(8, 16)] * 3)
    assert opened.listings == 0
    assert {r: st.step for r, st in watch.mon.ranks.items()} == {g: 1 for g in range(8, 16)}  # (none of 99: earlier)


def test_a_hang_is_named_by_the_node_of_the_stopped_rank_at_once_and_by_the_others_after_deferring(tmp_path):
    nodes = 64
    plan, rd = _job(tmp_path, nodes)
    watches = {n: HangWatch(rd, plan, n, started=T0) for n in (0, 1, 40)}
    for step in range(1, 5):  # every rank steps; rank 13 (node 1) stops after step 3, the others block after step 4
        for g in range(nodes * PPN):
            if not (g == 13 and step > 3):
                _beat(rd.heartbeats, g, step, T0 + step)
        for w in watches.values():
            assert w.poll(T0 + step + 0.5) == []
    quiet = T0 + 4.5 + STALL + 1  # every node's own ranks are silent now: each finds the hang from its own files
    stalls = {n: w.poll(quiet) for n, w in watches.items()}
    assert all(stalls.values())
    assert stalls[1][0].rank == 13  # the longest silent of node 1
    # node 1 holds the stopped rank: it names it at once
    text = watches[1].verdict(stalls[1], {13: 4242}, quiet, every=1.0)
    assert text is not None and text.startswith("rank 13 on node0001 hung: no heartbeat for ") and \
        "last step 3 (process 4242 is stopped)" in text
    # node 40's ranks all run: it leaves node 1 its time, then names the job's culprit, not one of its own
    assert watches[40].verdict(stalls[40], {}, quiet, every=1.0) is None
    assert watches[40].verdict(stalls[40], {}, quiet + DEFER_HANG_S, every=1.0) is None
    later = quiet + DEFER_HANG_S + 2.5
    text = watches[40].verdict(watches[40].poll(later), {}, later, every=1.0)
    assert text is not None and text.startswith("rank 13 on node0001 hung: no heartbeat for "), text
    assert "last step 3" in text

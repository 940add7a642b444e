"""The one Supervisor at a small scale of issue #29 (bench/bench_scale.py runs the large ones): 32 emulated nodes x 8
ranks heartbeating 4 times a second into the real Supervisor for 7 s (past a straggler window: the straggler judge
runs too), then node 1 fails. The supervising thread stays well under a quarter of a core, the failure is acted on
(every other node told to stop) within a second, the one slow rank is named and no other."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from bench_scale import measure  # noqa: E402


def test_256_ranks_at_4_hz_cost_little_and_a_death_is_acted_on_at_once(tmp_path):
    row = measure(32, 8, rate=4.0, seconds=7.0, progress=True, run_dir=str(tmp_path), slow_rank=77)
    assert row["heartbeats"] >= 256 * 4 * 6, row  # the stand-in kept up
    assert row["state"] == "FAILED" and "node 1 (node0001) failed" in row["root_cause"], row
    assert row["cpu_share"] < 0.25, row
    assert row["decision_s"] is not None and row["decision_s"] < 1.0, row
    assert row["stragglers"] == [77], row

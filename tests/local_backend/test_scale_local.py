"""Issue #29 at a small size on the local backend: 32 emulated nodes x 8 ranks (orchestrator.node.emulate), real node
agents, records, backend and Supervisor, submitted through the CLI. bench/bench_teardown.py measures 2-256 nodes.

Bounds, from bench/results/teardown.json (2026-11-28, this 2-core machine with other work on it): 64 local nodes,
kill -> last process gone ~1.3-1.7 s, the supervisor's stop ~0.1 s; 32 nodes take about half. The test allows 10 s
(CI machines are shared and slower) and 3 s for the decision. Threads of the submitter: one output pump per node
and a few of its own (measured nodes + 1), never one per rank: bound nodes + 16.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale_job import run_and_kill

NODES, PPN = 32, 8


def test_32_emulated_nodes_heartbeat_and_one_killed_launcher_tears_every_node_down(tmp_path):
    seen = run_and_kill(tmp_path, NODES, PPN)
    assert seen["processes"] >= 2 * NODES  # every node's agent and emulated launcher was found, on this machine
    assert seen["gone_s"] < 10.0, seen
    assert seen["decision_s"] is not None and 0 <= seen["decision_s"] < 3.0, seen
    assert seen["threads"] <= NODES + 16, seen  # a thread per node at most, none per rank (256 ranks here)
    assert seen["fds"] <= 3 * NODES + 64, seen  # launchers.base.FDS_PER_NODE
    out = seen["outcome"]
    assert seen["rc"] != 0 and out["state"] == "FAILED", out
    assert out["root_cause"].startswith(f"node {seen['victim']} "), out["root_cause"]
    ends = {n["node"]: n["end"] for n in out["nodes"]}
    assert ends[seen["victim"]] == "failed" and len(ends) == NODES
    assert all(e == "stopped" for r, e in ends.items() if r != seen["victim"]), ends

"""Issue #29 on the real SLURM testbed: 16 nodes (one slurmd per network namespace, scripts/slurm_cluster.sh) x 8
emulated ranks (orchestrator.node.emulate; the emulation reaches every node's agent through sbatch's exported
environment), real agents, records, backend and Supervisor, submitted through the CLI. bench/bench_teardown.py
--backends slurm measures 2-16 nodes.

Bounds, from bench/results/teardown.json (2026-11-28, this 2-core machine with other work on it): 16 nodes, kill ->
nothing but slurmd left in any node namespace 3.22 s (2.983-3.58), the supervisor's verdict (it hears of the nodes'
ends when SLURM says the job ended; --kill-on-bad-exit stops the others before) 0.968 s (0.953-3.62). The test allows
15 s for both (shared CI machines; SLURM's own KillWait is 5 s). Restarts are off (slurm.max_restarts 0): the killed
node ends the job. The testbed has 16 nodes for this test (slurm_helpers.CLUSTER_NODES); ~10 s once it is up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from slurm_helpers import NS_PREFIX, REPO, SCALE_NODES, cluster_nodes, resized

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scale_job import run_and_kill

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
NODES, PPN = SCALE_NODES, 8


@pytest.fixture
def slurm_16(slurm_cluster):
    yield from resized(NODES)


def test_16_slurm_nodes_x_8_emulated_ranks_one_killed_launcher_fails_the_job_and_stops_every_node(slurm_16, tmp_path):
    assert cluster_nodes(dict(os.environ)) == NODES
    c = yaml.safe_load((REPO / "cluster_configs" / "slurm_local.yaml").read_text())
    c["slurm"].update(python=sys.executable, workdir=str(tmp_path / "slurm-work"), max_restarts=0)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(c))
    seen = run_and_kill(tmp_path, NODES, PPN, cluster=cluster, start_timeout=90, gone_timeout=15,
                        runs=tmp_path / "slurm-work" / "runs", netns=NS_PREFIX)
    rd = seen["run_dir"]
    # every node's agent ran, each in its own node namespace, with its 8 emulated ranks heartbeating from that node
    assert seen["agents"] == list(range(NODES)) and len(seen["in_netns"]) == NODES, seen
    hosts = {r: json.loads((rd / "nodes" / str(r) / "agent.json").read_text())["host"] for r in range(NODES)}
    assert len(set(hosts.values())) == NODES, hosts
    for g in range(NODES * PPN):
        beats = [json.loads(line) for line in (rd / "heartbeats" / f"rank{g}.jsonl").read_text().splitlines()[:3]]
        assert any(b.get("event") == "step" for b in beats) and beats[0]["host"] == hosts[g // PPN], (g, beats)
    # the kill: nothing but slurmd left in any node namespace (run_and_kill waited for it), within the bound
    assert seen["gone_s"] < 15.0, seen
    assert seen["decision_s"] is not None and 0 <= seen["decision_s"] < 15.0, seen
    out = seen["outcome"]
    assert seen["rc"] != 0 and out["state"] == "FAILED", out
    assert out["root_cause"].startswith(f"node {seen['victim']} "), out["root_cause"]
    ends = {n["node"]: n for n in out["nodes"]}
    assert len(ends) == NODES and ends[seen["victim"]]["end"] == "failed", ends
    brief = {r: (n["end"], n.get("exit_code"), n.get("note")) for r, n in ends.items() if n["end"] != "stopped"}
    assert all(n["end"] == "stopped" for r, n in ends.items() if r != seen["victim"]), brief

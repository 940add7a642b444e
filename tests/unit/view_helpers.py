"""Fixtures of the operator views shared by the plain-text (golden) and the terminal-table tests: a two-node run
dir with heartbeats, agent and exit records, and `ls` rows."""

from __future__ import annotations

import json
from pathlib import Path

JOB_ROWS = [{"id": "sft_tiny-20261122-0400-ab12", "state": "RUNNING", "backend": "local", "nodes": 2, "step": 12,
             "created": 1000.0, "root_cause": None},
            {"id": "dpo-20261122-0300-cd34", "state": "COMPLETED", "backend": "slurm", "nodes": 4, "step": None,
             "created": 0.0, "root_cause": None}]


def status_fixture(tmp_path: Path) -> dict:
    """A FAILED ssh job `sft-1`: node 0 (gpu01) at step 5/10, node 1 (gpu02) at 3/10, stopped with exit 137."""
    run = tmp_path / "run"
    (run / "nodes" / "0").mkdir(parents=True)
    (run / "nodes" / "1").mkdir(parents=True)
    (run / "heartbeats").mkdir()
    (run / "plan.json").write_text(json.dumps({"world_size": 2, "procs_per_node": 1, "health": {},
                                               "node_plans": [{"node_rank": 0, "host": "gpu01", "ranks": [0]},
                                                              {"node_rank": 1, "host": "gpu02", "ranks": [1]}]}))
    (run / "nodes" / "0" / "agent.json").write_text(json.dumps({"host": "gpu01"}))
    (run / "nodes" / "1" / "exit.json").write_text(json.dumps({"returncode": 137, "stop_reason": "signal SIGTERM"}))
    for rank in (0, 1):
        lines = [json.dumps({"t": 1000.0 + s, "rank": rank, "host": f"gpu0{rank + 1}", "step": s, "max_steps": 10,
                             "loss": 6.0 - s * 0.5 - rank * 0.1, "tokens": s * 100, "event": "step",
                             "compute_s": 0.02 + 0.03 * rank})
                 for s in range(1, 6 - rank * 2)]
        (run / "heartbeats" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    (run / "stragglers.json").write_text(json.dumps({"named": [{"rank": 1, "host": "gpu02", "median_s": 0.05,
                                                                "others_s": 0.02, "ratio": 2.5, "window": 3, "step": 3,
                                                                "t": 1004.0, "attempt": 0, "action": "warn"}]}))
    return {"id": "sft-1", "state": "FAILED", "backend": "ssh", "handle": "ssh://sft-1", "cluster": "lab",
            "world_size": 2, "restarts": 1, "exit_code": 1, "root_cause": "node 1 (gpu02) failed: signal SIGKILL",
            "run_dir": str(run), "created": 900.0, "updated": 1010.0}

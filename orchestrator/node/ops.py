"""What runs on a node from outside a live agent: find the agents a run dir recorded, kill what they started, and
diagnose a hang (each rank's pid and process state, py-spy stacks). `python -m orchestrator.node.agent RUN_DIR
--kill | --diagnose` runs these on a node (over SSH, or locally), and the local and SLURM paths call them
directly; they work from nodes/R/agent.json and the launch token, so they also work when the agent is dead.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from orchestrator.node.proctools import alive, kill_marked, marked_ranks, signal_group, signal_pids


def recorded_agents(run_dir: Path, rank: int | None):
    """(node rank, agent.json) of one node or of every node that recorded an agent in this run dir."""
    nodes = run_dir / "nodes"
    ranks = [rank] if rank is not None else sorted(int(p.name) for p in nodes.iterdir() if p.name.isdigit()) \
        if nodes.is_dir() else []
    for r in ranks:
        try:
            yield r, json.loads((nodes / str(r) / "agent.json").read_text())
        except (OSError, ValueError):
            continue


def keep_stacks(run_dir: Path, pids: dict[int, int]) -> Path:
    """py-spy stacks of the given ranks (global rank -> pid) into RUN_DIR/stacks/rank<G>.txt."""
    from orchestrator.node.proctools import dump_stack
    d = run_dir / "stacks"
    d.mkdir(mode=0o700, exist_ok=True)
    for g, pid in sorted(pids.items()):
        (d / f"rank{g}.txt").write_text(dump_stack(pid))
    return d


def kill_node(run_dir: Path, rank: int | None, grace: float) -> int:
    """Tear down what a node agent started, from the outside (the agent itself may be dead)."""
    for _, info in recorded_agents(run_dir, rank):
        pid = info.get("agent_pid")
        if isinstance(pid, int) and alive(pid):
            signal_pids([pid], signal.SIGTERM)
        if info.get("token"):
            kill_marked(info["token"], grace=grace)
        for key in ("pgid", "agent_pgid"):
            if isinstance(info.get(key), int) and info[key] > 1:
                signal_group(info[key], signal.SIGKILL)
    return 0


def diagnose_node(run_dir: Path, rank: int | None, stacks: bool = True) -> int:
    """Print one JSON line per node: each rank's pid and /proc state (T = stopped), and keep py-spy stacks in
    RUN_DIR/stacks/. Run on the node (over SSH) when the monitor sees a hang, before the teardown."""
    from orchestrator.node.proctools import state
    for r, info in recorded_agents(run_dir, rank):
        pids = marked_ranks(str(info.get("token")))
        out = {"node_rank": r, "ranks": {str(g): {"pid": pid, "state": state(pid)} for g, pid in sorted(pids.items())}}
        if stacks and pids:
            out["stacks"] = str(keep_stacks(run_dir, pids))
        print(json.dumps(out, sort_keys=True), flush=True)
    return 0

"""What runs on a node from outside a live agent: kill what a run dir's agents started, and diagnose a hang (each
rank's pid and process state, py-spy stacks). `python -m orchestrator.node RUN_DIR --kill | --diagnose` runs these
on a node (over SSH, or locally), and the local path calls them directly; they work from the AgentRecords in the run
dir and the launch token, so they also work when the agent is dead. `node_status` (`--status`) says, per node, whether
its agent still runs and how it ended (its ExitRecord): what `orchestrate status` asks when nobody supervises a job.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from orchestrator.node.proctools import kill_marked, marked_ranks, same_process, signal_group, signal_pids, state
from orchestrator.node.rundir import AgentRecord, RunDir


def recorded_agents(run_dir: RunDir | Path, rank: int | None) -> list[tuple[int, AgentRecord]]:
    """(node rank, AgentRecord) of one node or of every node that recorded an agent in this run dir."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    ranks = [rank] if rank is not None else rd.node_ranks()
    out = []
    for r in ranks:
        rec = rd.agent(r)
        if rec is not None:
            out.append((r, rec))
    return out


def keep_stacks(run_dir: RunDir | Path, pids: dict[int, int], first: set[int] | None = None) -> Path:
    """The hang evidence of the given ranks (global rank -> pid): their responders asked first
    (node.hangevidence.collect: recorder entries and stacks, RUN_DIR/hangs/), then py-spy stacks into
    RUN_DIR/stacks/rank<G>.txt (0600), several ranks at once. Ranks in `first` (the stopped ones: the culprit) are
    dumped first, and retried once when py-spy got nothing."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.node.hangevidence import collect
    from orchestrator.node.proctools import dump_stack
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    rd.mkdir(RunDir.STACKS)
    first = first or set()
    nccl_dump(rd, pids)  # (NCCL's recorder writes its dump meanwhile)
    collect(rd, pids, first)

    def one(g: int, pid: int) -> None:
        text = dump_stack(pid)
        if g in first and "Thread" not in text:
            text = dump_stack(pid) or text
        rd.write_text(f"{RunDir.STACKS}/rank{g}.txt", text)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(pids)))) as pool:
        for _ in pool.map(lambda kv: one(*kv), sorted(pids.items(), key=lambda kv: (kv[0] not in first, kv[0]))):
            pass
    return rd.stacks


def nccl_dump(rd: RunDir, ranks) -> list[int]:
    """Ask torch's NCCL flight recorder of each rank to dump its trace next to the stacks: a GPU plan sets
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE=RUN_DIR/stacks/nccl_pipe_rank_ (torch makes the FIFO `<prefix><rank>` and dumps
    to TORCH_NCCL_DEBUG_INFO_TEMP_FILE when a byte arrives). Non-blocking; returns the ranks that were asked."""
    from orchestrator.node.hangevidence import poke
    return [g for g in ranks if poke(rd.stacks / f"nccl_pipe_rank_{g}")]  # (no FIFO: CPU, or no recorder)


def kill_node(run_dir: RunDir | Path, rank: int | None, grace: float) -> int:
    """Tear down what a node agent started, from the outside (the agent itself may be dead)."""
    for _, info in recorded_agents(run_dir, rank):
        if info.agent_pid > 1 and same_process(info.agent_pid, info.agent_proc_start):
            signal_pids([info.agent_pid], signal.SIGTERM)
        if info.token:
            kill_marked(info.token, grace=grace)
        for g in info.groups():
            signal_group(g, signal.SIGKILL)
        if info.container:  # a podman/docker container outlives its client: by name (core.container)
            from orchestrator.node.containers import remove_named
            remove_named(info.runtime, info.container)
    return 0


def stopped_ranks(run_dir: RunDir | Path, rank: int | None = None) -> tuple[dict[int, int], dict[int, int]]:
    """(every rank of the node(s) -> pid, the stopped ones (state T) -> pid), from the recorded launch tokens."""
    pids: dict[int, int] = {}
    for _, info in recorded_agents(run_dir, rank):
        if info.token:
            pids.update(marked_ranks(info.token))
    return pids, {g: p for g, p in sorted(pids.items()) if state(p) == "T"}


def diagnose_node(run_dir: RunDir | Path, rank: int | None, stacks: bool = True) -> int:
    """Print one JSON line per node: each rank's pid and /proc state (T = stopped), and keep the hang evidence
    (keep_stacks) in RUN_DIR/hangs/ and RUN_DIR/stacks/, also carried in the line ("hangs": node.hangevidence.export).
    Run on the node (over SSH) when the supervisor sees a hang, before the teardown."""
    for r, info in recorded_agents(run_dir, rank):
        pids = marked_ranks(info.token) if info.token else {}
        ranks = {str(g): {"pid": pid, "state": state(pid)} for g, pid in sorted(pids.items())}
        out = {"node_rank": r, "ranks": ranks}
        if stacks and pids:
            from orchestrator.node.hangevidence import export
            out["stacks"] = str(keep_stacks(run_dir, pids, {int(g) for g, v in ranks.items() if v["state"] == "T"}))
            out["hangs"] = export(run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir), pids)
        print(json.dumps(out, sort_keys=True), flush=True)
    return 0


def node_status(run_dir: RunDir | Path, rank: int | None) -> list[dict]:
    """Per node of the run dir: {"node_rank", "host", "agent_alive", "exit": ExitRecord as dict or None}."""
    from dataclasses import asdict
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    ranks = [rank] if rank is not None else rd.node_ranks()
    out = []
    for r in ranks:
        ag, ex = rd.agent(r), rd.exit(r)
        out.append({"node_rank": r, "host": ag.host if ag else "", "recorded": ag is not None,
                    "agent_alive": bool(ag and ag.agent_pid > 1 and same_process(ag.agent_pid, ag.agent_proc_start)),
                    "exit": asdict(ex) if ex else None})
    return out

"""Backend-neutral pieces of supervision: splitting streamed output into lines and naming the root
cause of a failed node from its exit status and last log lines (torchrun's failure summary included).
"""

from __future__ import annotations

import re
import signal

from orchestrator.types import NodeExit

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
_EXC = re.compile(r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)"
                  r"(?::.*)?)$", re.MULTILINE)
_LAUNCHER_NOISE = ("ChildFailedError", "SignalException")
# The node agent's own line when it ended a node because a rank died (orchestrator.node.rankwatch), before torchrun
# could print its error table.
_AGENT_DEATH = re.compile(r"orchestrate node agent: rank (\d+) \(pid \d+\) .*?\(exit (-?\d+)\)")
# Log lines that say a rank died because a PEER went away (a victim, not the root cause of a failure).
PEER_HINTS = ("Connection reset by peer", "Connection closed by peer", "connectFullMesh", "Broken pipe",
              "Socket closed", "ProcessGroupGloo", "recvBytes", "sendBytes")


def peer_victim(tail: str) -> bool:
    return any(h in tail for h in PEER_HINTS)


def pick_failed(candidates: list[NodeExit], exit_times: dict[int, float]) -> NodeExit:
    """Among nodes that failed before the teardown: the earliest (by the agents' exit times), unless its log
    only shows a dead peer and another candidate's does not."""
    ordered = sorted(candidates, key=lambda n: (exit_times.get(n.node_rank, float("inf")), n.node_rank))
    first = ordered[0]
    if peer_victim(first.log_tail):
        for other in ordered[1:]:
            if not peer_victim(other.log_tail):
                return other
    return first


def last_exception(text: str) -> tuple[int | None, str] | None:
    """The last Python exception line a rank printed (`[rank1]: ValueError: ...`), launcher noise skipped."""
    found = [(m.group(1), m.group(2).strip()) for m in _EXC.finditer(text)]
    found = [(r, e) for r, e in found if not any(n in e for n in _LAUNCHER_NOISE)]
    if not found:
        return None
    r, e = found[-1]
    return (int(r) if r is not None else None), e


def split_lines(buf: bytes) -> tuple[list[str], bytes]:
    """Complete lines (on \\n or \\r, progress bars included) and the unfinished rest."""
    parts = re.split(rb"[\r\n]", buf)
    rest = parts.pop()
    return [p.decode(errors="replace") for p in parts if p.strip()], rest


def describe_code(code: int | None) -> str:
    if code is None:
        return "unknown exit"
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            return f"signal {signal.Signals(num).name} (exit {code})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def root_cause_text(node: NodeExit) -> str:
    """`node 1 (host) failed: rank 1 died of signal SIGKILL (exit -9); last lines: ...`"""
    tail = node.log_tail or ""
    rank = _RANK.findall(tail)
    code = _EXITCODE.findall(tail)
    if not rank and _AGENT_DEATH.search(tail):
        rank, code = (list(x) for x in zip(_AGENT_DEATH.findall(tail)[-1]))
    who = f"node {node.node_rank} ({node.host})"
    detail = describe_code(node.returncode)
    if rank:
        rc = int(code[0]) if code else None
        detail = f"rank {rank[0]} {('died of ' + describe_code(rc)) if rc is not None and rc < 0 else describe_code(rc)}" \
                 f"; node {describe_code(node.returncode)}"
    exc = last_exception(tail)
    if exc is not None:
        r, e = exc
        return f"{who} failed: {detail}" + (f" | rank {r}: " if r is not None else " | ") + e[:300]
    last = [line for line in tail.splitlines() if line.strip() and not line.strip().startswith(("=", "-"))][-3:]
    return f"{who} failed: {detail}" + (" | last lines: " + " / ".join(s.strip()[:200] for s in last) if last else "")


def describe_hang(run_dir, plan, stalls, monitor) -> str:
    """Name the hung rank (`HealthMonitor.culprit`: a stopped process beats the longest-silent one), keep py-spy
    stacks of every local rank in RUN_DIR/stacks/, and return the root-cause line. Only sees this machine's
    processes."""
    import time
    from pathlib import Path
    from orchestrator.node.ops import keep_stacks, recorded_agents
    from orchestrator.node.proctools import marked_ranks, state
    run_dir = Path(run_dir)
    pids: dict[int, int] = {}
    for _, info in recorded_agents(run_dir, None):
        if info.get("token"):
            pids.update(marked_ranks(str(info["token"])))
    stopped = {r: pid for r, pid in sorted(pids.items()) if state(pid) == "T"}
    text = monitor.culprit(stalls, stopped, time.time())
    if plan.health.stack_dumps and pids:
        text += f"; stacks in {keep_stacks(run_dir, pids)}"
    return text

"""A job's node logs as `orchestrate logs` and `attach` print them: new complete lines of
RUN_DIR/logs/node<R>.log, filtered (`--node`, `--rank`, `--grep`), prefixed `[host nodeR rankG]` (a rank's line) or
`[host nodeR]` (the launcher's, the agent's), heartbeat lines left out.

`--rank G` reads only the log of the node that holds rank G (the plan's node_plans) and keeps only G's lines;
`--node R` reads only node R's log: neither touches the other nodes' logs (a 1,024-node job stays fast).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

from orchestrator.node.ranklines import prefix, split_rank


def log_filter(node: int | None, rank: int | None, grep: str | None) -> Callable[[int, int | None, str], bool]:
    """keep(node, rank, text): only `node`'s lines, only global `rank`'s lines (a line of no rank is not rank G's),
    whose text (without its prefix) matches the regular expression `grep`."""
    pattern = re.compile(grep) if grep else None

    def keep(n: int, r: int | None, text: str) -> bool:
        if node is not None and n != node:
            return False
        if rank is not None and r != rank:
            return False
        return pattern is None or bool(pattern.search(text))
    return keep


def node_of_rank(plan: dict, rank: int) -> int:
    """The node that holds global `rank`: the plan's node_plans[].ranks; else rank // procs_per_node."""
    for n in plan.get("node_plans", []):
        if rank in (n.get("ranks") or ()):
            return int(n["node_rank"])
    return rank // max(1, int(plan.get("procs_per_node") or 1))


class LogTail:
    """New complete lines of RUN_DIR/logs/node<R>.log since the last call, filtered, prefixed [host nodeR rankG]."""

    def __init__(self, run_dir, node: int | None = None, rank: int | None = None, grep: str | None = None,
                 tail_bytes: int | None = None, offsets: dict[int, int] | None = None):
        """`tail_bytes`: a log read for the first time is read from that many bytes before its end (its first, partial
        line left out; None: from its start). `offsets`: node -> where an earlier reader's complete lines ended
        (`positions()`): those logs are read on from there (the dashboard's live log is stateless)."""
        self.run_dir = Path(run_dir)
        try:
            plan = json.loads((self.run_dir / "plan.json").read_text())
        except (OSError, ValueError):
            plan = {}
        if rank is not None:
            node = node_of_rank(plan, rank)
        self.node = node
        self.keep = log_filter(node, rank, grep)
        self.hosts = {n["node_rank"]: n.get("host") or f"node{n['node_rank']}" for n in plan.get("node_plans", [])}
        self.tail_bytes = tail_bytes
        self.offsets: dict = {self._path(n): int(o) for n, o in (offsets or {}).items()}
        self.pending: dict = {}

    def _path(self, node: int) -> Path:
        return self.run_dir / "logs" / f"node{node}.log"

    def paths(self) -> list[tuple[int, Path]]:
        """(node, log) to read: the one node's when a node or rank is asked for (no directory listing), else all."""
        logs = self.run_dir / "logs"
        if self.node is not None:
            return [(self.node, self._path(self.node))]
        found = []
        for path in logs.glob("node*.log"):
            m = re.fullmatch(r"node(\d+)\.log", path.name)
            if m:
                found.append((int(m.group(1)), path))
        return sorted(found)

    def drain(self) -> None:
        for line in self.lines():
            print(line, flush=True)

    def lines(self, max_bytes: int | None = None) -> Iterator[str]:
        """The new complete lines of every log read, filtered and prefixed: what drain prints (`max_bytes`: at most
        that much of each log per call; the rest comes next time)."""
        for n, path in self.paths():
            try:
                with open(path, "rb") as f:
                    start, partial = self.offsets.get(path), False
                    if start is None and self.tail_bytes is not None:
                        start = max(0, f.seek(0, 2) - self.tail_bytes)
                        partial = start > 0
                    f.seek(start or 0)
                    data = self.pending.get(path, b"") + (f.read() if max_bytes is None else f.read(max_bytes))
                    self.offsets[path] = f.tell()
            except FileNotFoundError:  # (not yet: the node has not started)
                continue
            *lines, rest = re.split(rb"[\r\n]", data)
            self.pending[path] = rest
            for raw in lines[1:] if partial else lines:
                line = raw.decode(errors="replace")
                if not line.strip() or line.startswith("ORCHESTRATE_HB "):
                    continue
                r, text = split_rank(line)
                if self.keep(n, r, text):
                    yield f"{prefix(self.hosts.get(n, '?'), n, r)} {text}"

    def positions(self) -> dict[int, int]:
        """node -> where the complete lines read so far end in its log (a later LogTail's `offsets`)."""
        return {n: self.offsets[p] - len(self.pending.get(p, b"")) for n, p in self.paths() if p in self.offsets}

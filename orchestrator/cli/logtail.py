"""A job's node logs as `orchestrate logs` and `attach` print them: new complete lines of
RUN_DIR/logs/node<R>.log, filtered (`--node`, `--rank`, `--grep`), prefixed `[host nodeR]`, heartbeat lines left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable


def log_filter(node: int | None, rank: int | None, grep: str | None,
               procs_per_node: int = 1) -> Callable[[int, str], bool]:
    """keep(node, line): only `node`'s lines, or the lines of the node of global `rank` that are not another rank's
    (`[rankN]` prefix), matching the regular expression `grep`."""
    pattern = re.compile(grep) if grep else None
    other_rank = None
    if rank is not None:
        node = rank // procs_per_node
        other_rank = re.compile(r"^\[rank(\d+)\]")

    def keep(n: int, line: str) -> bool:
        if node is not None and n != node:
            return False
        if other_rank is not None:
            m = other_rank.match(line)
            if m and int(m.group(1)) != rank:
                return False
        return pattern is None or bool(pattern.search(line))
    return keep


class LogTail:
    """New complete lines of RUN_DIR/logs/node<R>.log since the last call, filtered, prefixed [host nodeR]."""

    def __init__(self, run_dir, node: int | None = None, rank: int | None = None, grep: str | None = None):
        self.run_dir = Path(run_dir)
        try:
            plan = json.loads((self.run_dir / "plan.json").read_text())
        except (OSError, ValueError):
            plan = {}
        self.keep = log_filter(node, rank, grep, int(plan.get("procs_per_node") or 1))
        self.hosts = {n["node_rank"]: n.get("host") or f"node{n['node_rank']}" for n in plan.get("node_plans", [])}
        self.offsets: dict = {}
        self.pending: dict = {}

    def drain(self) -> None:
        for path in sorted((self.run_dir / "logs").glob("node*.log")):
            m = re.fullmatch(r"node(\d+)\.log", path.name)
            if not m:
                continue
            n = int(m.group(1))
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = self.pending.get(path, b"") + f.read()
                self.offsets[path] = f.tell()
            *lines, rest = re.split(rb"[\r\n]", data)
            self.pending[path] = rest
            for raw in lines:
                line = raw.decode(errors="replace")
                if line.strip() and not line.startswith("ORCHESTRATE_HB ") and self.keep(n, line):
                    print(f"[{self.hosts.get(n, '?')} node{n}] {line}", flush=True)

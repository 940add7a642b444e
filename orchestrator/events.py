"""The backend event vocabulary: what a running job's backend reports and the one `Supervisor` consumes.

A leaf both sides import: the launchers (top-level `launchers/`) emit these events through the `Running` protocol
and act when told (`stop`, `stopped_ranks`); `orchestrator.supervise` decides (teardown, root cause, hang culprit,
restart). Nothing here decides anything: no policy, no I/O beyond a queue drain. An import-linter contract keeps
the launchers off the supervisor (pyproject: `launchers-report-only`).
"""

from __future__ import annotations

import queue
import re
from dataclasses import dataclass
from typing import Protocol

from orchestrator.node.rundir import ExitRecord
from orchestrator.types import JobState

@dataclass(frozen=True)
class Line:
    node: int
    text: str


@dataclass(frozen=True)
class Beat:
    record: dict


@dataclass(frozen=True)
class NodeEnded:
    """A node's launch is over (or the node is lost: `lost` says why, and `returncode` is None)."""

    node: int
    host: str
    returncode: int | None
    tail: str = ""
    record: ExitRecord | None = None  # the agent's own record: beats whatever the transport reported
    lost: str = ""


@dataclass(frozen=True)
class SchedulerEnd:
    """The scheduler's final word on the job (SLURM): its state and, for a failure, why."""

    state: JobState
    reason: str = ""


Event = Line | Beat | NodeEnded | SchedulerEnd


def drain(q: queue.Queue, timeout: float) -> list:
    """A backend's `events`: wait up to `timeout` for the first event its threads queued, then take all there are."""
    out = []
    try:
        out.append(q.get(timeout=timeout))
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        pass
    return out


class Running(Protocol):
    """A submitted job as its backend observes it. `handle` is recorded in the store."""

    handle: object
    nodes: dict[int, str]  # node rank -> host
    decides_hangs_on_nodes: bool  # True: the node agents judge hangs themselves (SLURM); we only back them up
    grace: float  # the backend's TERM -> KILL grace for a cancel or a hang (ranks may checkpoint on TERM)

    def events(self, timeout: float) -> list[Event]: ...

    def stop(self, reason: str, grace: float, nodes: set[int] | None = None) -> None: ...

    def stopped_ranks(self, stacks: bool = True) -> dict[int, int]: ...  # ranks found stopped -> pid; keeps stacks

    def close(self) -> None: ...


def split_lines(buf: bytes) -> tuple[list[str], bytes]:
    """Complete lines (on \\n or \\r, progress bars included) and the unfinished rest."""
    parts = re.split(rb"[\r\n]", buf)
    rest = parts.pop()
    return [p.decode(errors="replace") for p in parts if p.strip()], rest

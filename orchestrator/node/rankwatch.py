"""Fail fast on a dead rank, on its own node: the node agent watches its ranks' processes directly.

torchrun notices a dead worker on its own poll, then stops, prints its error table and exits: ~0.7-0.9 s
measured here before the node's launch is gone, and the other nodes wait for that. `RankWatch` learns the
pids of this node's ranks (the launch's marked processes with RANK set), holds a pidfd on each and wakes
the moment one exits. Its exit status is read from /proc while it is a zombie (torchrun reaps on a 0.1 s
poll, we are woken at once; while the rank still shows as exiting rather than a zombie, the read is retried for up
to 0.2 s). On a loaded machine torchrun can reap it first: then the rank's own exit record (rank<G>.exit, written
by the start-up hooks as the interpreter exits; orchestrate_hooks) gives the code it asked for, and a record with no
code says it left through Python's exit, not killed. A rank that exits non-zero before its last heartbeat says
"end"/"preempted", or whose status is unknown (no record of this pid) and whose last heartbeat is some other event,
died before finishing: `wait` returns a `RankDeath` and the agent ends the node at once. Everything else (status
0, a failing exit after "end"/"preempted", an exit whose code only torchrun knows, or unknown status with no
heartbeat to judge by) is left to torchrun.
"""

from __future__ import annotations

import json
import os
import select
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.node.proctools import marked_ranks, state, zombie_exit_status

DONE_EVENTS = ("end", "preempted")


@dataclass(frozen=True)
class RankDeath:
    rank: int
    pid: int
    status: int | None  # -N: killed by signal N; else the exit code; None: reaped before we could read it
    last_event: str | None
    container: str = ""  # the node's container, when it was killed from outside (`podman kill`): status is its signal

    def describe(self) -> str:
        import signal as _signal
        if self.status is None:
            how = "exited (status unknown)"
        elif self.status < 0:
            try:
                name = _signal.Signals(-self.status).name
            except ValueError:
                name = f"signal {-self.status}"
            how = f"died of {name} (exit {self.status})"
        else:
            how = f"exited with code {self.status} (exit {self.status})"
        killed = f": its container {self.container} was killed" if self.container else ""
        return (f"rank {self.rank} (pid {self.pid}) {how} before finishing{killed} (last heartbeat: "
                f"{self.last_event or 'none'})")

    @property
    def exit_code(self) -> int:
        """The code the node reports for it: 128+N for a signal, else the rank's exit code (1 when unknown)."""
        if self.status is None:
            return 1
        return 128 - self.status if self.status < 0 else (self.status or 1)


def last_event(heartbeat_dir: Path, rank: int) -> str | None:
    """The event of the last complete line of heartbeats/rank<G>.jsonl (reads only the file's tail)."""
    try:
        with open(heartbeat_dir / f"rank{rank}.jsonl", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return str(json.loads(line).get("event"))
        except (ValueError, AttributeError):
            continue
    return None


def exit_record(heartbeat_dir: Path, rank: int, pid: int) -> tuple[bool, int | None]:
    """(found, code) from heartbeats/rank<G>.exit when it was written by process `pid` (an earlier attempt's record
    never counts); code None: the rank left through Python's exit with a code it did not name."""
    try:
        rec = json.loads((heartbeat_dir / f"rank{rank}.exit").read_text())
    except (OSError, ValueError):
        return False, None
    if not isinstance(rec, dict) or rec.get("pid") != pid:
        return False, None
    code = rec.get("code")
    return True, code if isinstance(code, int) else None


class RankWatch:
    def __init__(self, token: str, ranks: list[int], heartbeat_dir: Path, scan_every: float = 0.2,
                 found: Callable[[dict[int, int]], None] | None = None):
        self.found = found  # called with `pids` whenever a scan found more of them (the agent's lease names them)
        self.token = token
        self.ranks = set(ranks)
        self.heartbeat_dir = Path(heartbeat_dir)
        self.scan_every = scan_every
        self.pids: dict[int, int] = {}  # global rank -> pid

    def _classify(self, rank: int, pid: int) -> RankDeath | None:
        status = zombie_exit_status(pid)
        deadline = time.monotonic() + 0.2
        while status is None and state(pid) not in (None, "Z") and time.monotonic() < deadline:
            # woken while the rank is still exiting (a many-threaded process ends thread by thread): its wait
            # status is readable once it shows as a zombie
            time.sleep(0.002)
            status = zombie_exit_status(pid)
        event = last_event(self.heartbeat_dir, rank)
        if status is None:  # reaped before we could read it: what the rank itself recorded as it exited
            found, code = exit_record(self.heartbeat_dir, rank, pid)
            if found:
                if code is None or code == 0:
                    return None  # it left through Python's exit: torchrun has the code and reports it
                status = code
        if status == 0 or (status is None and (event is None or event in DONE_EVENTS)):
            return None  # a clean end (or nothing to judge by): torchrun decides
        if status is not None and status > 0 and event in DONE_EVENTS:
            return None  # it finished training; a failing exit after that is torchrun's to report
        return RankDeath(rank, pid, status, event)

    def wait(self, stopped: Callable[[], bool]) -> RankDeath | None:
        """Block until a rank of this node dies before finishing (-> RankDeath), or `stopped()` turns true / every
        rank ended cleanly (-> None)."""
        fds: dict[int, tuple[int, int]] = {}  # pidfd -> (rank, pid)
        seen: set[int] = set()
        try:
            while not stopped():
                if len(seen) < len(self.ranks):
                    before = len(seen)
                    for g, pid in marked_ranks(self.token).items():
                        if g in self.ranks and g not in seen:
                            seen.add(g)
                            self.pids[g] = pid
                            try:
                                fds[os.pidfd_open(pid)] = (g, pid)
                            except OSError:  # already gone: judge it now
                                death = self._classify(g, pid)
                                if death:
                                    return death
                    if len(seen) > before and self.found is not None:
                        self.found(dict(self.pids))
                elif not fds:
                    return None
                ready, _, _ = select.select(list(fds), [], [], self.scan_every)
                for fd in ready:
                    g, pid = fds.pop(fd)
                    os.close(fd)
                    death = self._classify(g, pid)
                    if death and not stopped():
                        return death
            return None
        finally:
            for fd in fds:
                os.close(fd)

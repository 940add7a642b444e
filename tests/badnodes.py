"""Helpers of the bad-node tests (issue #26): find a job's ranks by the testbed host they run on, and a fault that
strikes one host's rank each time it trains (a bad machine that fails every attempt).

Every testbed host (loopback sshd, private host) runs on this machine: a rank's environment says which one (sshd's
SSH_CONNECTION: its 3rd word is the server address, the host) and which job (ORCHESTRATE_JOB_ID)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


def _env(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def ranks_on(host: str, job: str) -> dict[int, int]:
    """Global rank -> pid of `job`'s ranks on testbed host `host`."""
    out: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        env = _env(pid)
        if f"ORCHESTRATE_JOB_ID={job}".encode() not in env:
            continue
        conn = next((e.split(b"=", 1)[1].split() for e in env if e.startswith(b"SSH_CONNECTION=")), [])
        rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
        if len(conn) > 2 and conn[2].decode() == host and rank is not None and rank.isdigit():
            out[int(rank)] = int(pid)
    return out


def job_ids(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "runs").iterdir()) if (home / "runs").is_dir() else []


class HostKiller:
    """SIGKILLs `job`'s rank on `host` each time the job has trained `after` steps more than when it was last struck
    (the furthest step in its run dir), at most `times` times: a host that crashes every attempt."""

    def __init__(self, home: Path, host: str, after: int, times: int):
        self.home, self.host, self.after, self.times = home, host, after, times
        self.kills: list[tuple[float, int, int]] = []  # (time, step, pid)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from orchestrator.node.rundir import RunDir
        last = 0
        while not self.done.is_set() and len(self.kills) < self.times:
            jobs = job_ids(self.home)
            if jobs:
                rd = RunDir(self.home / "runs" / jobs[-1])
                step = rd.furthest_step() or 0
                mine = ranks_on(self.host, jobs[-1])
                if mine and step >= last + self.after:
                    pid = next(iter(mine.values()))
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.kills.append((time.time(), step, pid))
                        last = step
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)

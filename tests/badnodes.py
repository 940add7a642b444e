"""Helpers of the bad-node tests (issue #26): find a job's ranks by the testbed host they run on, and a fault that
strikes one host's rank each time it trains (a bad machine that fails every attempt).

Every testbed host (loopback sshd, private host) runs on this machine: a rank's environment says which one (sshd's
SSH_CONNECTION: its 3rd word is the server address, the host) and which job (ORCHESTRATE_JOB_ID)."""

from __future__ import annotations

import json
import os
import random
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
    """SIGKILLs `job`'s rank on `host` once attempt 0 has written `after` training steps (the first strike) or the
    rank's new process has itself written `then` steps (each later one), at most `times` times: a host that crashes
    every attempt. Counting a later process's own steps (the lines its rank's heartbeat file gained since the process
    was first seen) makes every strike land in its attempt whatever the step numbers a resume starts from; counting the
    first from the file's start strikes attempt 0 on time even when its rank is found late on a loaded machine, which
    leaves the later attempts their steps (CI once found it 20 steps in, struck at 30, and the job's last 10 steps
    ended before the second strike)."""

    def __init__(self, home: Path, host: str, after: int, times: int, then: int = 2):
        self.home, self.host, self.after, self.then, self.times = home, host, after, then, times
        self.kills: list[tuple[float, int, int]] = []  # (time, step, pid)
        self.seen: list[tuple[float, int, int, int]] = []  # (time, rank, pid, offset): each process it watched
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        struck: set[int] = set()
        target: tuple[int, Path] | None = None  # the live rank on the host: (pid, its heartbeat file)
        offset, steps = 0, set()
        while not self.done.is_set() and len(self.kills) < self.times:
            if target is None or not Path(f"/proc/{target[0]}").exists():
                target, steps = None, set()
                jobs = job_ids(self.home)  # (the /proc scan is slow: only until this attempt's rank is found)
                mine = ranks_on(self.host, jobs[-1]) if jobs else {}
                live = [(r, p) for r, p in mine.items() if p not in struck]
                if live:
                    rank, pid = live[0]
                    f = self.home / "runs" / jobs[-1] / "heartbeats" / f"rank{rank}.jsonl"
                    # the first strike counts attempt 0's steps from the file's start: a rank found late (the /proc
                    # scan is slow on a loaded machine) is struck at once, leaving the later attempts their steps
                    target, offset = (pid, f), (f.stat().st_size if f.exists() and self.kills else 0)
                    self.seen.append((time.time(), rank, pid, offset))
                else:
                    time.sleep(0.1)
                    continue
            try:  # the steps this process wrote since it was found (polled every 10 ms: a tiny model steps in 30 ms)
                with open(target[1], "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except OSError:
                data = b""
            cut = data.rfind(b"\n") + 1
            offset += cut
            for line in data[:cut].decode(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "step" and isinstance(rec.get("step"), int):
                    steps.add(rec["step"])
            if len(steps) >= (self.then if self.kills else self.after):
                struck.add(target[0])
                try:
                    os.kill(target[0], signal.SIGKILL)
                    self.kills.append((time.time(), max(steps), target[0]))
                except ProcessLookupError:
                    pass
                target = None
                continue
            time.sleep(0.01)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)


def ranks_of(job: str) -> dict[int, int]:
    """Global rank -> pid of `job`'s ranks on this machine (any backend: the environment torchrun gave each rank)."""
    out: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        env = _env(pid)
        if f"ORCHESTRATE_JOB_ID={job}".encode() not in env:
            continue
        rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
        try:
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if any(e.startswith(b"RANK=") for e in _env(ppid)):
            continue  # a worker the rank spawned (it inherits RANK), not the rank
        if rank is not None and rank.isdigit():
            out[int(rank)] = int(pid)
    return out


class Throttler:
    """A slow but alive rank: SIGSTOP / SIGCONT in a duty cycle (stopped `stop_s` of every `period_s`) on the rank
    that `find()` names (a pid, or None while it is not there yet), until stopped; it always leaves it running."""

    def __init__(self, find, stop_s: float = 0.015, period_s: float = 0.03):
        self.find, self.stop_s, self.period_s = find, stop_s, period_s
        self.cycles = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pid = None
        while not self.done.is_set():
            if pid is None or not Path(f"/proc/{pid}").exists():
                pid = self.find()
                if pid is None:
                    time.sleep(0.2)
                    continue
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(self.stop_s)
            except ProcessLookupError:
                pid = None
                continue
            finally:
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pid = None
            self.cycles += 1
            time.sleep(random.uniform(0, 2 * (self.period_s - self.stop_s)))  # (random: never phase-locked to steps)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)

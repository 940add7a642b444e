"""The host side of leases (orchestrator.core.leases says which locks and why): flock on files every user can use.

`take(locks, holder)` takes every lock without waiting (a lock held for a moment by someone looking is tried again
for up to TRY_S) and returns a `Held` (keep it: the locks live as long as its descriptors; the kernel drops them when
the last process holding one ends, however it ends: the node agent passes them to its launch, so a job's lease
outlives a killed agent until its launch and ranks are gone) or the first busy lock `{"host", "lock", "what",
"holder"}`.
`held(locks)` says the same without keeping anything (the local launcher's look before it starts agents).

The directory is created mode 1777 (sticky, world-writable, like /tmp) and each lock file 0666 (whatever the umask),
so another user's agent can lock them; an existing file is opened without O_CREAT (Linux's protected_regular refuses
O_CREAT on another user's file in a sticky directory). Standard library only: this runs on hosts without orchestrate.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.leases import LEASE_DIR, LEASE_DIR_VAR, Lock, gpu_prefix

TRY_S = 1.0  # a lock busy for less than this (someone looking, see `held`) is not a busy host


def lease_dir() -> str:
    return os.environ.get(LEASE_DIR_VAR) or LEASE_DIR


def _ensure_dir(d: str) -> None:
    try:
        os.mkdir(d, 0o1777)
        os.chmod(d, 0o1777)  # the umask took bits off
    except FileExistsError:
        pass


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:  # another agent created it in between
        return os.open(path, os.O_RDWR)
    try:
        os.fchmod(fd, 0o666)
    except OSError:
        pass
    return fd


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read().strip() or "null")
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _try(fd: int, exclusive: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


@dataclass
class Held:
    """Locks this process holds (one descriptor each); `release` drops them (the kernel does when the process ends)."""

    fds: list[int] = field(default_factory=list)
    previous: dict[str, Any] | None = None  # who held the first exclusive lock last (its file's holder before ours)
    holder: dict[str, Any] | None = None  # what the files held exclusive say (`note` adds the job's processes)
    named: list[tuple[int, str]] = field(default_factory=list)  # (fd, lock name) of each lock held exclusive

    def note(self, procs: list[tuple[int, float | None]]) -> None:
        """Name the job's processes on this host (pid, start time) in each file held exclusive: whoever takes the lock
        next waits until they are gone (`outlived`), however this holder ended and whatever order they die in."""
        if self.holder is None:
            return
        for fd, name in self.named:
            data = (json.dumps(dict(self.holder, lock=name, procs=procs), sort_keys=True) + "\n").encode()
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            except OSError:
                pass

    def release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def holder_of(d: str, lk: Lock, host: str) -> dict[str, Any] | None:
    """Who holds `lk` (busy for us): the file's holder when it is held exclusive; a host held shared (by GPU-subset
    jobs) is named by the first of its GPU locks that is held."""
    path = os.path.join(d, lk.name)
    fd = _open(path)
    try:
        shared_only = _try(fd, False)  # a shared lock on a file held exclusive fails
    finally:
        os.close(fd)
    if not shared_only:
        return _read(path)
    prefix = gpu_prefix(host)
    for name in sorted(os.listdir(d)):
        if name.startswith(prefix) and name.endswith(".lock"):
            fd = _open(os.path.join(d, name))
            try:
                free = _try(fd, False)
            finally:
                os.close(fd)
            if not free:
                return _read(os.path.join(d, name))
    return None


def take(locks: list[Lock], holder: dict[str, Any] | None, host: str,
         try_s: float = TRY_S) -> tuple[Held | None, dict | None]:
    """Take every lock (all or none), writing `holder` into each one held exclusive (None: only looking). (Held, None),
    or (None, the first busy lock) after `try_s` of trying."""
    d = lease_dir()
    _ensure_dir(d)
    deadline = time.monotonic() + try_s
    while True:
        held, busy, last = Held(holder=holder), None, None
        for lk in locks:
            fd = _open(os.path.join(d, lk.name))
            if not _try(fd, lk.exclusive):
                os.close(fd)
                busy = lk
                break
            held.fds.append(fd)
            if lk.exclusive:
                held.named.append((fd, lk.name))
                before = _read(os.path.join(d, lk.name))
                held.previous = held.previous or before
                if outlived(before):  # its holder is gone, a process of its job is not: still its lease
                    busy, last = lk, before
                    break
        if busy is None:
            if holder is not None:  # the holder's name in each file it holds alone
                held.note([])
            return held, None
        held.release()
        if time.monotonic() >= deadline:
            return None, {"host": host, "lock": busy.name, "what": busy.what,
                          "holder": last or holder_of(d, busy, host)}
        time.sleep(0.1)


def outlived(holder: dict[str, Any] | None) -> bool:
    """Whether a process its last holder named (Held.note) still runs: the lock is free, the job is not gone yet."""
    from orchestrator.node.proctools import same_process
    procs = (holder or {}).get("procs") or []
    return any(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and same_process(p[0], p[1])
               for p in procs)


def leased_gpus(host: str) -> tuple[int, ...]:
    """The GPUs of `host` whose lock someone holds now (the local planner gives a new job others)."""
    d, prefix = lease_dir(), gpu_prefix(host)
    try:
        names = os.listdir(d)
    except OSError:
        return ()
    out = []
    for name in names:
        index = name[len(prefix):-len(".lock")] if name.startswith(prefix) and name.endswith(".lock") else ""
        if not index.isdigit():
            continue
        try:
            fd = _open(os.path.join(d, name))
        except OSError:
            continue
        try:
            if not _try(fd, False):
                out.append(int(index))
        finally:
            os.close(fd)
    return tuple(sorted(out))


def held(locks: list[Lock], host: str) -> dict | None:
    """The first of `locks` someone else holds (as `take` reports it), or None; holds nothing afterwards."""
    got, busy = take(locks, None, host)
    if got is not None:
        got.release()
    return busy

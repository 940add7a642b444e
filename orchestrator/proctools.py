"""Process-group facts from /proc (Linux): who is in a group, is a pid alive (zombies count as dead),
and group signalling that tolerates races. Used by the node agent, the launchers and the tests.
"""

from __future__ import annotations

import os
import signal
import time


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, pgrp) of a pid, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = data[data.rfind(")") + 2:].split()
    return rest[0], int(rest[2])


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st and st[1] == pgid and st[0] not in ("Z", "X"):
            out.append(int(name))
    return sorted(out)


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def kill_group(pgid: int, grace: float = 5.0, poll: float = 0.05) -> float:
    """TERM the group, KILL whatever is left after `grace` seconds. Returns seconds until empty."""
    t0 = time.monotonic()
    if not group_members(pgid):
        return 0.0
    signal_group(pgid, signal.SIGTERM)
    deadline = t0 + grace
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return time.monotonic() - t0
        time.sleep(poll)
    signal_group(pgid, signal.SIGKILL)
    while group_members(pgid) and time.monotonic() < deadline + 5:
        time.sleep(poll)
    return time.monotonic() - t0

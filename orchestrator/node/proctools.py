"""Process facts from /proc (Linux): who is in a group, who carries a job's marker, is a pid alive
(zombies count as dead), signalling that tolerates races, and running a short command in a session of
its own that a cancel or a deadline stops whole (`run_apart`). Used by the node agent, the launchers and
the tests.

Why a marker: torchrun starts every worker in a NEW session (start_new_session=True), so killing the
launcher's process group misses the ranks, and a rank whose launcher died is re-parented to init.
Every process of a launch inherits ORCHESTRATE_JOB_TOKEN=<token> in its environment; `marked(token)`
finds them all wherever they are in the process tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from orchestrator.core.container import TOKEN_VAR  # (the one definition; containers pass it in by name)


def _read(path: str, chunk: int = 8192) -> bytes | None:
    """A small /proc file's bytes (None when it cannot be read: the process is gone). os.open/os.read: a scan of
    every process reads thousands of these, and a buffered file object costs more than the read itself."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, chunk)
        while len(data) % chunk == 0 and data:  # (a large environment: the rest)
            more = os.read(fd, chunk)
            if not more:
                break
            data += more
        return data
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on (the command name, which may hold spaces and ")", cut off), or
    None when the process is gone."""
    data = _read(f"/proc/{pid}/stat")
    if data is None:
        return None
    return data[data.rfind(b")") + 2:].decode(errors="replace").split()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, pgrp) of a pid, or None when it is gone."""
    rest = _stat_fields(pid)
    return (rest[0], int(rest[2])) if rest else None


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
    if not signal_group(pgid, 0) or not group_members(pgid):  # (no process in it at all: one syscall, no scan)
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


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall-clock time the kernel created `pid`: its start in clock ticks after boot (field 22), against
    /proc/uptime (10 ms resolution; /proc/stat's btime is whole seconds)."""
    rest = _stat_fields(pid)
    try:
        ticks = int(rest[19])  # type: ignore[index]
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError, TypeError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def same_process(pid: int, start: float | None, tolerance: float = 1.0) -> bool:
    """`pid` runs and is the process that started at `start` (a process_start_time() taken while it ran; None: not
    recorded, running decides). A recorded pid whose process has ended may since belong to an unrelated process:
    signalling it would hit that one."""
    if not alive(pid):
        return False
    if start is None:
        return True
    now = process_start_time(pid)
    return now is not None and abs(now - float(start)) <= tolerance


def group_is_ours(pgid: int, leader_start: float | None) -> bool:
    """Whether the process group `pgid` is still the one whose leader started at `leader_start`. While any process
    is in a group its id cannot be handed out again, so a group without a living leader is still ours; a living
    process with pid == pgid that started at another time means the id was reused (ours ended, leader and all)."""
    st = _stat(pgid)
    if leader_start is None or st is None or st[0] in ("Z", "X"):
        return True
    return same_process(pgid, leader_start)


def zombie_exit_status(pid: int) -> int | None:
    """The exit status of a process that has exited but is not reaped yet (a zombie), as subprocess reports it
    (-N killed by signal N, else the exit code); None when it is running or already reaped. /proc/PID/stat field
    52 (Linux >= 3.5) holds the wait status until the parent reaps it."""
    rest = _stat_fields(pid)
    if not rest or rest[0] != "Z":
        return None
    try:
        status = int(rest[49])
    except (IndexError, ValueError):
        return None
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def state(pid: int) -> str | None:
    """The one-letter /proc state (R, S, D, T = stopped, Z ...) or None when gone."""
    st = _stat(pid)
    return st[0] if st else None


def dump_stack(pid: int, timeout: float = 20.0) -> str:
    """A Python stack dump of `pid` with py-spy (non-blocking read; works on stopped processes; full file names,
    so that the hang analysis tells library frames from the user's)."""
    import shutil
    import subprocess
    import sys
    exe = shutil.which("py-spy") or str(__import__("pathlib").Path(sys.executable).with_name("py-spy"))
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking", "--full-filenames"], capture_output=True,
                           text=True, timeout=timeout)
        return r.stdout + r.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no stack dump for pid {pid}: {e}"


def _environ(pid: int) -> list[bytes]:
    data = _read(f"/proc/{pid}/environ")
    return data.split(b"\0") if data else []


def _carries(data: bytes, item: bytes) -> bool:
    """Whether a NUL-separated environment holds exactly `item` (NAME=value), without splitting it."""
    at = data.find(item)
    while at >= 0:
        end = at + len(item)
        if (at == 0 or data[at - 1] == 0) and (end == len(data) or data[end] == 0):
            return True
        at = data.find(item, at + 1)
    return False


def marked(token: str) -> list[int]:
    """Live pids whose environment carries ORCHESTRATE_JOB_TOKEN=token (this user's, or all as root). One scan of
    /proc: each process's environ read raw and searched, not parsed (on a machine of many processes, such as loopback
    hosts sharing one, every node agent's teardown scans them all)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        data = _read(f"/proc/{name}/environ")
        if data and needle in data and _carries(data, needle) and alive(int(name)):
            out.append(int(name))
    return sorted(out)


def marked_ranks(token: str) -> dict[int, int]:
    """Global rank -> pid among a launch's marked processes (those with RANK set: the workers)."""
    return ranks_of(marked(token))


def ranks_of(pids: list[int]) -> dict[int, int]:
    """Global rank -> pid among `pids` (marked processes; those with RANK set: the workers)."""
    out: dict[int, int] = {}
    for pid in pids:
        for item in _environ(pid):
            if item.startswith(b"RANK="):
                try:
                    out.setdefault(int(item[5:]), pid)
                except ValueError:
                    pass
                break
    return out


def signal_pids(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_marked(token: str, grace: float = 5.0, poll: float = 0.05) -> float:
    """TERM (+CONT, so stopped ranks act on it) every marked process, KILL what is left after `grace`."""
    t0 = time.monotonic()
    pids = marked(token)
    if not pids:
        return 0.0
    signal_pids(pids, signal.SIGTERM)
    signal_pids(pids, signal.SIGCONT)
    while time.monotonic() - t0 < grace:
        pids = marked(token)
        if not pids:
            return time.monotonic() - t0
        time.sleep(poll)
    for _ in range(50):
        pids = marked(token)
        if not pids:
            break
        signal_pids(pids, signal.SIGKILL)
        time.sleep(poll)
    return time.monotonic() - t0


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux prctl PR_SET_CHILD_SUBREAPER): a descendant
    orphaned later (its parent died, or it double-forked into a session of its own) is re-parented to this process,
    not to init, so "no child left" proves that none of them is left (`sweep_launch`). False where that cannot be
    done (not Linux): the caller then always scans."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def has_children() -> bool:
    """Whether this process has a child, running or a zombie. Reaps nothing (WNOWAIT): another thread's Popen may be
    waiting for it."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def reap_zombies_apart() -> None:
    """Reap this process's zombie children that are in another session than its own: a subreaper's re-parented
    orphans of its launch (a launch starts in a session of its own; the agent's helpers, each waited for by the
    Popen that started it, run in the agent's session and are left alone). Stops at the first zombie it must
    leave."""
    mine = os.getsid(0)
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        rest = _stat_fields(info.si_pid)
        if not rest or rest[0] != "Z" or int(rest[3]) == mine:
            return
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            return


def children_apart() -> list[int]:
    """Live children of this process in another session than its own (see reap_zombies_apart). One scan of /proc
    (its stat files only)."""
    me, mine = os.getpid(), os.getsid(0)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        rest = _stat_fields(name)
        if rest and rest[0] not in ("Z", "X") and int(rest[1]) == me and int(rest[3]) != mine:
            out.append(int(name))
    return sorted(out)


def kill_children_apart(grace: float = 5.0, poll: float = 0.05) -> float:
    """TERM (+CONT) this process's children in other sessions (what a subreaper's launch left behind, whatever its
    environment), again as theirs are re-parented in turn, KILL what is left after `grace`. Seconds until none."""
    t0 = time.monotonic()
    told: set[int] = set()
    while time.monotonic() - t0 < grace + 5:
        reap_zombies_apart()
        kids = children_apart()
        if not kids:
            break
        late = time.monotonic() - t0 >= grace
        new = kids if late else [k for k in kids if k not in told]
        signal_pids(new, signal.SIGKILL if late else signal.SIGTERM)
        signal_pids(new, signal.SIGCONT)
        told.update(new)
        time.sleep(poll)
    return time.monotonic() - t0


def sweep_launch(pgid: int, token: str, grace: float, subreaper: bool) -> bool:
    """After a launch (started in its own session and group `pgid`, its processes marked with `token`) has ended and
    been reaped: make sure nothing of it is left. A subreaper with no child left has proof that nothing is (every
    descendant of the launch is one of its children or theirs): no scan at all. Otherwise (not a subreaper, or a
    child remains) the group and the marked processes are TERMed then KILLed, and a subreaper's children in other
    sessions (the launch's orphans, marker or not) as well. True when it had to sweep."""
    if subreaper:
        reap_zombies_apart()  # (orphans of the launch that have exited: a child, but nothing left to kill)
        if not has_children():
            return False
    kill_group(pgid, grace=grace)
    kill_marked(token, grace=grace)
    if subreaper:
        kill_children_apart(grace=grace)
    return True


class Cancelled(Exception):
    """`run_apart`'s command was stopped because its cancel event was set."""


def run_apart(argv: list[str], timeout: float, cancel: threading.Event | None = None,
              poll: float = 0.1) -> subprocess.CompletedProcess:
    """Run `argv` to its end in a session of its own (out of the terminal's process group: a Ctrl-C or hang-up
    sent to the group does not reach it), its output captured as text. `cancel` set: its whole session is killed
    within `poll` seconds and Cancelled raised; past `timeout` seconds: killed the same way, TimeoutExpired.
    Any other exception in the caller's thread while it runs (a KeyboardInterrupt) kills it too and propagates."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8", errors="replace",
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=poll)
                return subprocess.CompletedProcess(argv, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(argv[0]) from None
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout) from None
    except BaseException:
        if proc.returncode is None:  # (not reaped yet: its group id is still its own, never another's)
            signal_group(proc.pid, signal.SIGKILL)  # the whole session (a wrapper's children keep the pipes open)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise

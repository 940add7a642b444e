"""State and per-node I/O of one running SSH job (the launcher itself is launchers/ssh.py).

Owns: `Node` (one host's agent: its channel, wrapper pid, recorded process groups, exit, output tail) and
`Job` (the nodes, their connection pool, the event queue the launcher waits on, local heartbeat copies, the
line sink), and what touches one job's nodes over their open connections: copying the run dir out
(`copy_run_dir`, SFTP 0700/0600), the per-node output pump (`pump`: RUN_DIR/logs/node<R>.log, the tail,
forwarded heartbeats), reading the agents' nodes/R/{agent,exit}.json, fetching them and the heartbeats back
(`fetch_back`), asking each node which rank is stopped when the job hangs (`diagnose_hang`), and picking the
root cause among the failed nodes. Every SFTP use holds the connection's one session exclusively
(`with conn.sftp() as sftp`): paramiko's SFTPClient is not safe for concurrent requests.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from orchestrator.core.health import HealthMonitor
from orchestrator.node.heartbeat import parse_forwarded
from orchestrator.types import JobResult
from orchestrator.launchers.ssh.remote import WRAPPER_MARK
from orchestrator.supervise import PEER_HINTS

logger = logging.getLogger("orchestrate.ssh")
TAIL_LINES = 20


@dataclass
class Node:
    rank: int
    host: str
    run_dir: str  # on the host
    argv: tuple[str, ...] = ()
    chan: Any = None
    wrapper_pid: int | None = None
    agent: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None
    exited_at: float | None = None
    exit_record: dict[str, Any] | None = None
    torn_down_at: float | None = None
    pending: bytes = b""  # output read past the probe line, not yet processed
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def pgids(self) -> list[int]:
        out = []
        for k in ("agent_pgid", "pgid"):
            v = self.agent.get(k)
            if isinstance(v, int) and v > 1 and v not in out:
                out.append(v)
        return out


class Job:
    def __init__(self, job_id: str, local_run_dir: Path, nodes: list[Node], pool: Any, shared_fs: bool):
        self.job_id = job_id
        self.local_run_dir = local_run_dir
        self.nodes = nodes
        self.pool = pool
        self.shared_fs = shared_fs
        self.events: queue.Queue = queue.Queue()
        self.state = "RUNNING"
        self.result: JobResult | None = None
        self._sink: Callable[[int, str], None] | None = None
        self._pending: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self.teardown_started: float | None = None
        self.cancel_reason = ""
        self.hang = ""
        self.monitor: HealthMonitor | None = None
        self.hb_files: dict[int, Any] = {}

    def heartbeat(self, rec: dict[str, Any]) -> None:
        """Feed the health monitor and keep a local copy (status/plot work without a shared filesystem)."""
        if self.monitor is not None:
            self.monitor.feed(rec, time.time())
        if self.shared_fs or not isinstance(rec.get("rank"), int):
            return
        fh = self.hb_files.get(rec["rank"])
        if fh is None:
            d = self.local_run_dir / "heartbeats"
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            fh = self.hb_files[rec["rank"]] = open(d / f"rank{rec['rank']}.jsonl", "a")
        fh.write(json.dumps(rec, sort_keys=True) + "\n")
        fh.flush()

    def emit(self, rank: int, line: str) -> None:
        with self._lock:
            if self._sink is None:
                self._pending.append((rank, line))
                return
            sink = self._sink
        sink(rank, line)

    def set_sink(self, sink: Callable[[int, str], None]) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._sink = sink
        for rank, line in pending:
            sink(rank, line)


def copy_run_dir(conn: Any, local: Path, rels: list[str], remote: str) -> None:
    with conn.sftp() as sftp:
        copy_with(sftp, local, rels, remote)


def copy_with(sftp: Any, local: Path, rels: list[str], remote: str) -> None:
    made: set[str] = set()

    def mkdirs(path: str) -> None:
        parts = path.rstrip("/").split("/")
        for i in range(2, len(parts) + 1):
            p = "/".join(parts[:i])
            if not p or p in made:
                continue
            try:
                sftp.stat(p)
            except FileNotFoundError:
                sftp.mkdir(p, 0o700)
                sftp.chmod(p, 0o700)
            made.add(p)

    mkdirs(remote)
    for sub in ("logs", "heartbeats", "nodes"):
        mkdirs(f"{remote}/{sub}")
    for rel in rels:
        src = local / rel
        files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
        for f in files:
            dst = f"{remote}/{f.relative_to(local).as_posix()}"
            mkdirs(dst.rsplit("/", 1)[0])
            with sftp.open(dst, "wb") as fh:
                fh.chmod(0o600)  # before any byte is written
                fh.set_pipelined(True)
                fh.write(f.read_bytes())


def pump(job: Job, node: Node) -> None:
    fd = os.open(job.local_run_dir / "logs" / f"node{node.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    log = os.fdopen(fd, "ab", buffering=0)
    buf = node.pending  # what arrived after the probe line
    quiet_since = None
    try:
        node.chan.settimeout(0.2)
        while True:
            try:
                data = node.chan.recv(65536)
            except socket.timeout:
                # The agent exited but something (an orphan of a killed agent) may still hold the
                # output pipe open: stop reading once the exit status is in and output is quiet.
                if node.chan.exit_status_ready():
                    now = time.monotonic()
                    quiet_since = quiet_since or now
                    if now - quiet_since >= 0.3:
                        break
                continue
            if not data:
                break
            buf += data
            *lines, buf = re.split(rb"[\r\n]", buf)
            for raw in lines:
                _line(job, node, raw, log)
        if buf:
            _line(job, node, buf, log)
        rc = node.chan.recv_exit_status()
    except Exception:  # noqa: BLE001 - connection lost
        rc = -1
    finally:
        log.close()
    logger.debug("node %d on %s: output closed, exit status %s", node.rank, node.host, rc)
    recorded = read_exit(job, node)  # the agent's own record beats what the wrapper reports
    if recorded is not None:
        node.exit_record = recorded
        rc = int(recorded.get("returncode", rc))
    node.returncode = rc
    node.exited_at = time.monotonic()
    logger.debug("node %d on %s exited: %s (agent record: %s)", node.rank, node.host, rc, recorded)
    node.done.set()
    job.events.put(node.rank)


def _line(job: Job, node: Node, raw: bytes, log: Any) -> None:
    if not raw.strip():
        return
    text = raw.decode(errors="replace")
    if node.wrapper_pid is None and text.startswith(WRAPPER_MARK):
        try:
            node.wrapper_pid = int(text[len(WRAPPER_MARK):])
        except ValueError:
            pass
        return
    hb = parse_forwarded(text)
    if hb is not None:
        job.heartbeat(hb)
        job.emit(node.rank, text)
        return
    log.write(raw + b"\n")
    node.tail.append(text)
    job.emit(node.rank, text)


def read_exit(job: Job, node: Node) -> dict[str, Any] | None:
    """nodes/R/exit.json as the agent wrote it (None when it did not get that far)."""
    conn = job.pool.conns.get(node.host)
    if conn is None or not conn.alive:
        return None
    try:
        with conn.sftp() as sftp, sftp.open(f"{node.run_dir}/nodes/{node.rank}/exit.json", "rb") as fh:
            data = json.loads(fh.read().decode())
        return data if isinstance(data, dict) and isinstance(data.get("returncode"), int) else None
    except Exception:  # noqa: BLE001 - missing file, connection gone
        return None


def read_agent(job: Job, node: Node) -> bool:
    """Fetch nodes/R/agent.json (pid, pgid) from the host once it exists."""
    if node.agent:
        return True
    try:
        with job.pool.conns[node.host].sftp() as sftp, \
                sftp.open(f"{node.run_dir}/nodes/{node.rank}/agent.json", "rb") as fh:
            node.agent = json.loads(fh.read().decode())
    except (OSError, ValueError, KeyError, EOFError):
        return False
    except Exception:  # noqa: BLE001 - paramiko SSHException when the connection is gone
        return False
    if not job.shared_fs:
        d = job.local_run_dir / "nodes" / str(node.rank)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(d / "agent.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(node.agent))
    job.emit(node.rank, f"orchestrate: {node.host} node/{node.rank} agent pid {node.agent.get('agent_pid')} "
             f"pgid {node.agent.get('pgid')} (recorded in nodes/{node.rank}/agent.json)")
    return True


def exit_times(job: Job) -> dict[int, float]:
    """When each node's launch ended, from the agents' exit.json (fetched back or shared)."""
    out = {}
    for n in job.nodes:
        p = job.local_run_dir / "nodes" / str(n.rank) / "exit.json"
        try:
            out[n.rank] = float(json.loads(p.read_text())["time"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return out


def fetch_back(job: Job) -> None:
    """Bring nodes/R/{agent,exit}.json and heartbeats back to the local run dir (not shared_fs)."""
    if job.shared_fs:
        return

    def one(host: str) -> None:
        n = node_at_host(job.nodes, host)
        conn = job.pool.conns.get(host)
        if conn is None or not conn.alive:
            return
        with conn.sftp() as sftp:
            wanted = [f"nodes/{n.rank}/agent.json", f"nodes/{n.rank}/exit.json"]
            try:
                wanted += [f"heartbeats/{f}" for f in sftp.listdir(f"{n.run_dir}/heartbeats")]
            except OSError:
                pass
            for rel in wanted:
                try:
                    dst = job.local_run_dir / rel
                    dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as fh:
                        sftp.getfo(f"{n.run_dir}/{rel}", fh)
                except OSError:
                    pass

    try:
        job.pool.map(one, [n.host for n in job.nodes])
    except Exception:  # noqa: BLE001 - best effort
        pass


def diagnose_hang(job: Job, stalls, python: str) -> str:
    """Ask every node which of its ranks is stopped (and keep their stacks) before the teardown: the
    stopped rank is the culprit; else the one silent longest."""
    from orchestrator.launchers.ssh.transport import remote_command
    stopped: dict[int, int] = {}

    def one(host: str) -> None:
        n = node_at_host(job.nodes, host)
        conn = job.pool.conns.get(host)
        if conn is None or not conn.alive:
            return
        cmd = remote_command([python, "-m", "orchestrator.node.agent", n.run_dir,
                              "--node-rank", str(n.rank), "--diagnose"])
        rc, out, _ = conn.run(cmd, timeout=30)
        for line in out.decode(errors="replace").splitlines():
            try:
                for g, info in json.loads(line).get("ranks", {}).items():
                    if info.get("state") == "T":
                        stopped[int(g)] = int(info["pid"])
            except (ValueError, AttributeError):
                continue
    try:
        job.pool.map(one, [n.host for n in job.nodes])
    except Exception:  # noqa: BLE001 - diagnosis is best effort; the teardown must happen regardless
        pass
    return job.monitor.culprit(stalls, stopped, time.time()) + "; stacks in RUN_DIR/stacks/ on each host"


def pick_root_cause(failed: list[Node], exit_times: dict[int, float] | None = None) -> Node:
    """The node that failed first (by the agents' exit times when every candidate has one, else by
    when its connection reported the exit), unless it only reports a dead PEER and another does not."""
    times = exit_times or {}
    if len(failed) > 1 and all(n.rank in times for n in failed):
        failed = sorted(failed, key=lambda n: times[n.rank])
    first = failed[0]
    if any(h in line for line in first.tail for h in PEER_HINTS):
        for other in failed[1:]:
            if not any(h in line for line in other.tail for h in PEER_HINTS):
                return other
    return first


def node_at_host(nodes: list[Node], host: str) -> Node:
    return next(n for n in nodes if n.host == host)


def rank_at_host(nodes: list[Node], host: str) -> int:
    return node_at_host(nodes, host).rank


def node_at_rank(nodes: list[Node], rank: int) -> Node:
    return next(n for n in nodes if n.rank == rank)

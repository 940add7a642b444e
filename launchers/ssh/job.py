"""A running SSH job and its per-node I/O (the launcher itself is launchers/ssh/launcher.py).

Owns: `Node` (one host's agent: its channel, wrapper pid, AgentRecord, exit, output tail) and `SSHJob` (the
supervisor's view of the job: orchestrator.events.Running), and what touches one job's nodes over their open
connections: copying the run dir out (`copy_run_dir`, SFTP 0700/0600), the per-node output pump (`pump`:
RUN_DIR/logs/node<R>.log, the tail, forwarded heartbeats as events, the node's end), reading the agents' records,
fetching them and the heartbeats back (`fetch_back`), the teardown of a node (`teardown_node`) and asking each node
which rank is stopped when the job hangs (`diagnose`). Every SFTP use holds the connection's one session
exclusively (`with conn.sftp() as sftp`): paramiko's SFTPClient is not safe for concurrent requests.
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
from typing import Any

from launchers.ssh.remote import WRAPPER_MARK, describe_exit, teardown_command
from orchestrator.node.agent import agent_argv
from orchestrator.node.heartbeat import parse_forwarded
from orchestrator.node.rundir import AgentRecord, ExitRecord, RunDir, parse_agent, parse_exit, parse_exit_line
from orchestrator.events import Beat, Line, NodeEnded, drain

logger = logging.getLogger("orchestrate.ssh")
TAIL_LINES = 20
UNREACHABLE_S = 5.0  # a host silent this long to SSH keepalives is lost
# A node's output thread wakes this often while nothing arrives (only to see its host given up, or its agent's exit
# status in while an orphan of a killed agent holds the output open; then every 0.1 s): 256 threads of the pump.
PUMP_WAKE_S = 1.0
HEARD_S = 1.0  # a host whose output arrived this recently is asked no keepalive (_watch_links)
STOP_MARGIN_S = 3.0  # a node told to stop and still running this long past the grace: the teardown program over SSH


@dataclass
class Node:
    rank: int
    host: str
    run_dir: str  # on the host
    argv: tuple[str, ...] = ()
    chan: Any = None
    wrapper_pid: int | None = None
    agent: AgentRecord | None = None
    returncode: int | None = None
    exited_at: float | None = None
    torn_down_at: float | None = None
    pending: bytes = b""  # output read past the probe line, not yet processed
    lost: str = ""  # why the node was given up (its host stopped answering)
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    printed_exit: ExitRecord | None = None  # the exit record its agent printed, not having been able to write it
    done: threading.Event = field(default_factory=threading.Event)
    heard_at: float = 0.0  # (monotonic) the last output that came from the node's host: the link answers

    @property
    def prefix(self) -> tuple[str, ...]:
        """What goes before the python of any agent command on this host (a staged node package's PYTHONPATH):
        the words between `setsid -w` and the python of the agent's own argv."""
        words = self.argv[2:] if self.argv[:2] == ("setsid", "-w") else self.argv
        return tuple(words[:words.index("-m") - 1]) if "-m" in words else ()

    @property
    def pgids(self) -> list[int]:
        return list(dict.fromkeys(self.agent.groups())) if self.agent else []


class SSHJob:
    """A running SSH job as the supervisor sees it (orchestrator.events.Running): events from every node's output
    pump (lines, forwarded heartbeats, the node's end with its agent's ExitRecord), and the actions it is told to
    take (stop: the teardown program on every host, in the background, so a dead link never blocks; stopped_ranks:
    `--diagnose` on every host with a short timeout)."""

    decides_hangs_on_nodes = False

    def __init__(self, job_id: str, run_dir: RunDir, nodes: list[Node], pool: Any, shared_fs: bool, python: str,
                 handle: Any = None, grace: float = 2.0):
        self.grace = grace
        self.job_id, self.rd, self.node_list, self.pool, self.shared_fs = job_id, run_dir, nodes, pool, shared_fs
        self.python = python
        self.nodes = {n.rank: n.host for n in nodes}
        self.handle = handle
        self.q: queue.Queue = queue.Queue()
        self._hb_dir = False  # RUN_DIR/heartbeats made (the local copies of forwarded heartbeats)
        self._threads: list[threading.Thread] = []
        self.outputs: dict[str, Any] | None = None  # staged hosts: {ssh, python, key, local, fetch, workdirs}

    # ---------------------------------------------------------------- what the pumps report
    def heartbeat(self, rec: dict[str, Any]) -> None:
        """A forwarded heartbeat: an event, and a local copy (status/plot work without a shared filesystem), appended
        with an open/write/close of its own: no file kept open per rank (8,192 ranks would need 8,192 fds)."""
        self.q.put(Beat(rec))
        if self.shared_fs or not isinstance(rec.get("rank"), int):
            return
        if not self._hb_dir:
            self.rd.mkdir(RunDir.HEARTBEATS)
            self._hb_dir = True
        try:
            fd = os.open(self.rd.path(RunDir.heartbeat_rel(rec["rank"])), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o600)
        except OSError:
            return
        try:
            os.write(fd, (json.dumps(rec, sort_keys=True) + "\n").encode())  # (one write: whole lines, O_APPEND)
        except OSError:
            pass
        finally:
            os.close(fd)

    def emit(self, rank: int, line: str) -> None:
        self.q.put(Line(rank, line))

    def start(self) -> None:
        for n in self.node_list:
            for target, name in ((pump, "out"), (watch_agent, "agent")):
                t = threading.Thread(target=target, args=(self, n), daemon=True, name=f"ssh-node{n.rank}-{name}")
                t.start()
                self._threads.append(t)
        threading.Thread(target=self._watch_links, daemon=True, name="ssh-links").start()

    def _watch_links(self) -> None:
        """A host that leaves SSH keepalives unanswered for UNREACHABLE_S is lost, in every phase (start-up
        included): its node ends as `lost`, so the supervisor names the host and stops the healthy ones at once."""
        while not all(n.done.is_set() for n in self.node_list):
            for n in self.node_list:
                conn = self.pool.conns.get(n.host)
                if n.done.is_set() or conn is None:
                    continue
                if time.monotonic() - n.heard_at < HEARD_S:
                    continue  # its output arrived just now: the link answers without a keepalive round trip
                silent = conn.silent_for()
                if silent >= UNREACHABLE_S:
                    conn.dead = True
                    n.lost = (f"host {n.host} stopped answering (no SSH keepalive reply for {silent:.0f} s): "
                              "network down or host lost")
                    n.done.set()
                    self.q.put(NodeEnded(n.rank, n.host, None, "\n".join(n.tail), None, n.lost))
            time.sleep(1.0)

    # ---------------------------------------------------------------- Running
    def events(self, timeout: float) -> list:
        return drain(self.q, timeout)

    def stop(self, reason: str, grace: float, nodes: set[int] | None = None) -> None:
        """Stop every selected node: each agent is told over its open channel (a stop line on its stdin, then EOF:
        it TERMs its launch, KILLs after `grace`), by one thread for all of them, nothing started on the hosts. A
        node still running STOP_MARGIN_S past the grace (an agent that cannot act: stopped, hung, its channel full)
        gets the teardown program over SSH (its recorded groups and marked processes), hosts in parallel through
        the pool's threads. The caller never waits: an unreachable host delays nobody."""
        targets = [n for n in self.node_list if (nodes is None or n.rank in nodes) and not n.done.is_set()]
        now = time.monotonic()
        for n in targets:
            n.torn_down_at = now
        if targets:
            threading.Thread(target=self._stop, args=(targets, reason, grace), daemon=True,
                             name="ssh-teardown").start()

    def _stop(self, nodes: list[Node], reason: str, grace: float) -> None:
        line = (json.dumps({"stop": reason, "grace": grace}) + "\n").encode()
        told = [n for n in nodes if tell_stop(n, line)]
        deadline = time.monotonic() + grace + STOP_MARGIN_S
        for n in told:
            n.done.wait(max(0.0, deadline - time.monotonic()))
        left = [n for n in nodes if not n.done.is_set() and not n.lost]
        if left:
            logger.debug("teardown: %d node(s) not ended %.1f s after being told: the teardown program on their hosts",
                         len(left), grace + STOP_MARGIN_S)
            by_host = {n.host: n for n in left}
            try:
                self.pool.map(lambda h: teardown_node(self, by_host[h], grace), list(by_host))
            except Exception as e:  # noqa: BLE001 - the pool closed meanwhile (the job ended)
                logger.debug("teardown fallback: %s", e)

    def stopped_ranks(self, stacks: bool = True) -> dict[int, int]:
        return diagnose(self, self.python)  # the agents' --diagnose keeps stacks on each host

    def close(self) -> None:
        for n in self.node_list:
            n.done.wait(timeout=2)
        fetch_back(self)
        fetch_job_outputs(self)
        self.pool.close()


def fetch_job_outputs(job: SSHJob) -> None:
    """outputs.fetch (docs/staging.md): bring the output dir (or its newest checkpoint) back from every node's host
    after the job, whatever its end; what came back is recorded in RUN_DIR/fetched.json."""
    o = job.outputs
    if not o or o["fetch"] == "none":
        return
    from launchers.ssh.stage import fetch_outputs
    nodes = [(n.host, o["workdirs"][n.rank]) for n in sorted(job.node_list, key=lambda n: n.rank) if not n.lost]
    logger.warning("fetching the outputs (%s) from %d host(s) into %s ...", o["fetch"], len(nodes), o["local"])
    t0 = time.time()
    summary = fetch_outputs(job.pool, o["ssh"], nodes, o["key"], Path(o["local"]), o["fetch"])
    summary["seconds"] = round(time.time() - t0, 3)
    logger.warning("fetched %d file(s), %.1f MB in %.1f s%s", summary["files"], summary["bytes"] / 1e6,
                   summary["seconds"], "".join(f"; {h}: {e}" for h, e in summary["errors"].items()))
    try:
        job.rd.write_json("fetched.json", summary)
    except OSError:
        pass


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


def pump(job: SSHJob, node: Node) -> None:
    """One node's output -> RUN_DIR/logs/node<R>.log and events; at its end, a NodeEnded with the agent's record."""
    try:
        fd = os.open(job.rd.log(node.rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log = os.fdopen(fd, "ab", buffering=0)
    except OSError:  # a full disk / unwritable run dir: the lines still stream
        log = open(os.devnull, "ab", buffering=0)
    buf = node.pending  # what arrived after the probe line
    quiet_since = None
    try:
        node.chan.settimeout(PUMP_WAKE_S)
        while True:
            if node.lost:
                return  # given up (host unreachable): its end is already reported
            try:
                data = node.chan.recv(65536)
                node.heard_at = time.monotonic()
            except socket.timeout:
                # The agent exited but something (an orphan of a killed agent) may still hold the
                # output pipe open: stop reading once the exit status is in and output is quiet.
                if node.chan.exit_status_ready():
                    node.chan.settimeout(0.1)
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
    if node.lost:
        return
    logger.debug("node %d on %s: output closed, exit status %s", node.rank, node.host, rc)
    recorded = read_exit(job, node) or node.printed_exit  # the agent's own record beats what the wrapper reports
    node.returncode = recorded.returncode if recorded else rc
    node.exited_at = time.monotonic()
    if recorded is not None or rc == 0:
        lost = ""
    elif rc is None or rc < 0:
        lost = describe_exit(rc)[0]
    elif 0 < rc < 65:  # no exit record: the agent was killed; `setsid -w` reports the killing signal's number,
        lost = f"the node agent was killed by {_signal_name(rc)} (no exit record)"
        node.returncode = 128 + rc  # shown in the shell's convention (137 = SIGKILL), never as if it exited 9
    else:
        lost = f"the node agent ended ({describe_exit(rc)[0]}) without an exit record: killed or crashed"
    node.done.set()
    job.q.put(NodeEnded(node.rank, node.host, node.returncode, "\n".join(node.tail), recorded, lost))


def _signal_name(num: int) -> str:
    import signal as _signal
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _line(job: SSHJob, node: Node, raw: bytes, log: Any) -> None:
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
        return
    printed = parse_exit_line(text)
    if printed is not None:  # the agent could not write its exit record (a full disk): its printed copy stands in
        node.printed_exit = printed
        return
    try:
        log.write(raw + b"\n")
    except OSError:
        pass  # a full disk: the line still streams
    node.tail.append(text)
    job.emit(node.rank, text)


def read_exit(job: SSHJob, node: Node) -> ExitRecord | None:
    """nodes/R/exit.json as the agent wrote it (None when it did not get that far)."""
    conn = job.pool.conns.get(node.host)
    if conn is None or not conn.alive:
        return None
    try:
        with conn.sftp() as sftp, sftp.open(f"{node.run_dir}/{RunDir.node_rel(node.rank, 'exit.json')}", "rb") as fh:
            return parse_exit(json.loads(fh.read().decode()))
    except Exception:  # noqa: BLE001 - missing file, connection gone
        return None


def read_agent(job: SSHJob, node: Node) -> bool:
    """Fetch nodes/R/agent.json (pids, groups, token) from the host once it exists; keep a local copy."""
    if node.agent is not None:
        return True
    try:
        with job.pool.conns[node.host].sftp() as sftp, \
                sftp.open(f"{node.run_dir}/{RunDir.node_rel(node.rank, 'agent.json')}", "rb") as fh:
            rec = parse_agent(json.loads(fh.read().decode()))
    except Exception:  # noqa: BLE001 - not there yet, or paramiko SSHException when the connection is gone
        return False
    if rec is None:
        return False
    node.agent = rec
    if not job.shared_fs:
        job.rd.write_agent(rec)
    job.emit(node.rank, f"orchestrate: {node.host} node/{node.rank} agent pid {rec.agent_pid} pgid {rec.pgid} "
             f"(recorded in nodes/{node.rank}/agent.json)")
    return True


def watch_agent(job: SSHJob, node: Node) -> None:
    """Read the node's AgentRecord as soon as the agent wrote it (teardown needs its groups)."""
    while not node.done.is_set() and not read_agent(job, node):
        node.done.wait(0.25)


def tell_stop(node: Node, line: bytes) -> bool:
    """Send a node's agent the stop line and EOF over its open channel; False when that cannot be done at once (no
    channel, closed, or its window full: a host that does not read)."""
    chan = node.chan
    try:
        if chan is None or chan.closed or not chan.send_ready():
            return False
        chan.sendall(line)
        chan.shutdown_write()  # EOF: the agent stops on it as well (and a lost line still ends the node)
        return True
    except Exception:  # noqa: BLE001 - the connection went away meanwhile
        return False


def teardown_node(job: SSHJob, node: Node, grace: float) -> None:
    read_agent(job, node)
    conn = job.pool.conns.get(node.host)
    if conn is not None and conn.alive:
        t0 = time.monotonic()
        try:
            rc, out, err = conn.run(teardown_command(node.wrapper_pid, node.pgids, grace, job.python, node.run_dir,
                                                     node.rank, node.prefix), timeout=2 * grace + 15)
            logger.debug("teardown %s node %d: rc %s %r %r in %.2fs", node.host, node.rank, rc, out, err[-300:],
                         time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the host went away meanwhile
            logger.debug("teardown %s node %d failed: %s", node.host, node.rank, e)
    try:
        if node.chan is not None and not node.done.is_set():
            node.chan.shutdown_write()  # stdin EOF: the agent tears its node down by itself too
    except Exception:  # noqa: BLE001
        pass


def fetch_back(job: SSHJob) -> None:
    """Bring nodes/R/{agent,exit}.json and heartbeats back to the local run dir (not shared_fs)."""
    if job.shared_fs:
        return

    def one(host: str) -> None:
        n = node_at_host(job.node_list, host)
        conn = job.pool.conns.get(host)
        if conn is None or not conn.alive:
            return
        with conn.sftp() as sftp:
            wanted = [RunDir.node_rel(n.rank, "agent.json"), RunDir.node_rel(n.rank, "exit.json")]
            try:
                wanted += [f"heartbeats/{f}" for f in sftp.listdir(f"{n.run_dir}/heartbeats")]
            except OSError:
                pass
            for rel in wanted:
                try:
                    dst = job.rd.path(rel)
                    job.rd.mkdir(str(Path(rel).parent))
                    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as fh:
                        sftp.getfo(f"{n.run_dir}/{rel}", fh)
                except OSError:
                    pass

    try:
        job.pool.map(one, [n.host for n in job.node_list if not n.lost])
    except Exception:  # noqa: BLE001 - best effort
        pass


def diagnose(job: SSHJob, python: str, timeout: float = 8.0) -> dict[int, int]:
    """Ask every reachable node which of its ranks is stopped (the agent keeps their stacks in RUN_DIR/stacks/ on its
    host) before the teardown. A host that does not answer within `timeout` is skipped: the teardown must not wait."""
    from launchers.ssh.transport import remote_command
    stopped: dict[int, int] = {}

    def one(node: Node) -> None:
        conn = job.pool.conns.get(node.host)
        if conn is None or not conn.alive:
            return
        rc, out, _ = conn.run(remote_command(node.prefix + agent_argv(python, node.run_dir, node_rank=node.rank,
                                                                      action="diagnose")), timeout=timeout)
        for line in out.decode(errors="replace").splitlines():
            try:
                if not job.shared_fs and isinstance(json.loads(line).get("hangs"), dict):
                    from orchestrator.node.hangevidence import absorb
                    absorb(job.rd, json.loads(line)["hangs"])  # the evidence, for the analysis here
                for g, info in json.loads(line).get("ranks", {}).items():
                    if info.get("state") == "T":
                        stopped[int(g)] = int(info["pid"])
            except (ValueError, AttributeError):
                continue
    threads = [threading.Thread(target=lambda n=n: _quietly(one, n), daemon=True) for n in job.node_list]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 1
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return dict(stopped)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - diagnosis is best effort
        logger.debug("diagnosis failed: %s", e)


def node_at_host(nodes: list[Node], host: str) -> Node:
    return next(n for n in nodes if n.host == host)


def rank_at_host(nodes: list[Node], host: str) -> int:
    return node_at_host(nodes, host).rank

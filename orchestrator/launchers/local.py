"""The local backend: N emulated nodes on this machine (loopback rendezvous), one node agent each.

Owns starting the agents (each in its own session, watching this process), streaming their output
into RUN_DIR/logs/node<R>.log and to the caller, and fail-fast supervision: the first node that exits
non-zero is the root cause and every other node is torn down (TERM to the agent, which stops its
process group; KILL of the recorded groups after a grace). Cancel works from another process too,
through the pids the agents record in RUN_DIR/nodes/<R>/agent.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from orchestrator.types import JobHandle, JobResult, NodeCommand, NodeExit, Submission
from orchestrator.supervise import describe_hang, pick_failed, root_cause_text, split_lines
from orchestrator.core.health import HealthMonitor
from orchestrator.node.heartbeat import HeartbeatTail
from orchestrator.core.jobplan import LaunchPlan
from orchestrator.node.proctools import alive, marked, signal_group, signal_pids


class LocalLauncher:
    kind = "local"

    def __init__(self, cluster=None, grace: float = 5.0):
        self.cluster = cluster
        self.grace = grace
        self._procs: dict[int, subprocess.Popen] = {}
        self._readers: list[threading.Thread] = []
        self._run_dir: Path | None = None
        self._first_failure: tuple[float, int] | None = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------- pure
    def prepare(self, plan: LaunchPlan) -> Submission:
        nodes = tuple(NodeCommand(node_rank=n.node_rank, host="localhost",
                                  argv=(plan.python, "-m", "orchestrator.node.agent", plan.run_dir,
                                        "--node-rank", str(n.node_rank)),
                                  env={}, secret_env=plan.secret_env) for n in plan.node_plans)
        return Submission(kind=self.kind, run_dir=plan.run_dir, nodes=nodes)

    # -------------------------------------------------------------- side effects
    def submit(self, submission: Submission, on_line: Callable[[int, str], None] | None = None) -> JobHandle:
        run_dir = Path(submission.run_dir)
        self._run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)
        env = dict(os.environ)
        for node in submission.nodes:
            argv = [*node.argv, "--parent-pid", str(os.getpid()), "--grace", str(self.grace), "--forward-heartbeats"]
            log = open(run_dir / "logs" / f"node{node.node_rank}.log", "ab", buffering=0)
            os.chmod(log.name, 0o600)
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self._procs[node.node_rank] = proc
            t = threading.Thread(target=self._pump, args=(node.node_rank, proc, log, on_line), daemon=True)
            t.start()
            self._readers.append(t)
        return JobHandle(uri=f"local://{run_dir.name}", data={"run_dir": str(run_dir),
                                                              "agents": {r: p.pid for r, p in self._procs.items()}})

    def _pump(self, rank: int, proc: subprocess.Popen, log, on_line) -> None:
        assert proc.stdout is not None
        pending = b""
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            log.write(chunk)
            pending += chunk
            lines, pending = split_lines(pending)
            if on_line:
                for line in lines:
                    on_line(rank, line)
        if pending and on_line:
            on_line(rank, pending.decode(errors="replace"))
        log.close()

    def wait(self, handle: JobHandle, on_line=None, poll: float = 0.05) -> JobResult:
        run_dir = Path(handle.data["run_dir"])
        plan = LaunchPlan.from_json((run_dir / "plan.json").read_text())
        monitor = HealthMonitor(plan.health, plan.world_size, started=time.time())
        tail = HeartbeatTail(run_dir / "heartbeats")
        hb_every = float(plan.health.poll_interval)
        next_hb = 0.0
        failed_rank: int | None = None
        torn_down_at = float("inf")
        hang: str | None = None
        cancelled = False
        try:
            while True:
                codes = {r: p.poll() for r, p in self._procs.items()}
                bad = [r for r, c in codes.items() if c not in (None, 0)]
                if bad and failed_rank is None and hang is None:
                    failed_rank = bad[0]
                    torn_down_at = time.time()
                    self._teardown(run_dir, exclude=set(bad))
                if all(c is not None for c in codes.values()):
                    break
                now = time.time()
                if now >= next_hb:
                    next_hb = now + hb_every
                    for rec in tail.read():
                        monitor.feed(rec, now)
                    stalls = monitor.stalls(now) if failed_rank is None and hang is None else []
                    if stalls:
                        hang = describe_hang(run_dir, plan, stalls, monitor)
                        self._teardown(run_dir)
                time.sleep(poll)
        except KeyboardInterrupt:
            cancelled = True
            self._teardown(run_dir)
            for p in self._procs.values():
                p.wait()
        for t in self._readers:
            t.join(timeout=5)
        for rec in tail.read():
            monitor.feed(rec, time.time())
        max_step = max((st.step for st in monitor.snapshot()), default=None)
        nodes = tuple(NodeExit(node_rank=r, host="localhost", returncode=p.returncode,
                               log_tail=_tail(run_dir / "logs" / f"node{r}.log"))
                      for r, p in sorted(self._procs.items()))
        if cancelled:
            return JobResult("CANCELLED", 130, "cancelled by the user (Ctrl-C)", nodes, max_step)
        if hang is not None:
            return JobResult("FAILED", 1, hang, nodes, max_step, hung=True)
        if failed_rank is None:
            return JobResult("COMPLETED", 0, "", nodes, max_step)
        # The root cause: among nodes that failed on their own (before our teardown), the first, unless its
        # log only shows a dead peer (gloo's "Connection reset by peer") and another node's does not.
        times = {n.node_rank: _exit_time(run_dir, n.node_rank) for n in nodes}
        own = [n for n in nodes if n.returncode not in (None, 0) and times[n.node_rank] <= torn_down_at + 0.2]
        node = pick_failed(own or [nodes[failed_rank]], times)
        return JobResult("FAILED", node.returncode or 1, root_cause_text(node), nodes, max_step)

    def _teardown(self, run_dir: Path, exclude: set[int] = frozenset()) -> None:
        """Stop every node (but `exclude`): TERM the agents, KILL the recorded groups after the grace."""
        targets = {r: p for r, p in self._procs.items() if r not in exclude and p.poll() is None}
        for p in targets.values():
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

        def hard_kill() -> None:
            deadline = time.monotonic() + self.grace + 1.0
            while time.monotonic() < deadline and any(p.poll() is None for p in targets.values()):
                time.sleep(0.05)
            for r in targets:
                for pgid in _recorded_groups(run_dir, r):
                    signal_group(pgid, signal.SIGKILL)
                token = _agent_info(run_dir, r).get("token")
                if token:
                    signal_pids(marked(token), signal.SIGKILL)
        threading.Thread(target=hard_kill, daemon=True).start()

    def cancel(self, handle: JobHandle) -> None:
        run_dir = Path(handle.data["run_dir"])
        if self._procs:
            self._teardown(run_dir)
            return
        cancel_run_dir(run_dir, self.grace)

    def status(self, handle: JobHandle) -> str:
        return run_dir_state(Path(handle.data["run_dir"]))

    def logs(self, handle: JobHandle, node_rank: int | None = None) -> Iterator[str]:
        run_dir = Path(handle.data["run_dir"])
        files = sorted((run_dir / "logs").glob("node*.log")) if node_rank is None else \
            [run_dir / "logs" / f"node{node_rank}.log"]
        for f in files:
            if f.exists():
                for line in f.read_text(errors="replace").splitlines():
                    yield f"[{f.stem}] {line}"


def _tail(path: Path, n: int = 60) -> str:
    try:
        data = path.read_bytes()[-16384:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.replace("\r", "\n").splitlines()[-n:])


def _exit_time(run_dir: Path, rank: int) -> float:
    try:
        return float(json.loads((run_dir / "nodes" / str(rank) / "exit.json").read_text())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("inf")


def _agent_info(run_dir: Path, rank: int) -> dict:
    try:
        return json.loads((run_dir / "nodes" / str(rank) / "agent.json").read_text())
    except (OSError, ValueError):
        return {}


def _recorded_groups(run_dir: Path, rank: int) -> list[int]:
    info = _agent_info(run_dir, rank)
    return [g for g in (info.get("pgid"), info.get("agent_pgid")) if isinstance(g, int) and g > 1]


def cancel_run_dir(run_dir: Path, grace: float = 5.0) -> None:
    """Cancel a local job from any process: what `node_agent --kill` does, for every node of the run dir."""
    from orchestrator.node.ops import kill_node
    kill_node(run_dir, None, grace)


def run_dir_state(run_dir: Path) -> str:
    nodes = sorted(int(p.name) for p in (run_dir / "nodes").iterdir() if p.name.isdigit()) \
        if (run_dir / "nodes").exists() else []
    exits = []
    for r in nodes:
        try:
            exits.append(json.loads((run_dir / "nodes" / str(r) / "exit.json").read_text())["returncode"])
        except (OSError, ValueError, KeyError):
            exits.append(None)
    if not nodes:
        return "UNKNOWN"
    if any(e not in (None, 0) for e in exits):
        return "FAILED" if all(e is not None for e in exits) else "FAILING"
    if all(e == 0 for e in exits):
        return "COMPLETED"
    running = any(alive(_agent_info(run_dir, r).get("agent_pid", -1)) for r in nodes)
    return "RUNNING" if running else "LOST"

"""The local backend: N emulated nodes on this machine (loopback rendezvous), one node agent each.

Owns starting the agents (each in its own session, watching this process), streaming their output into
RUN_DIR/logs/node<R>.log and as events, and acting when the supervisor says so (stop: TERM the agents, which stop
their launches; KILL of the recorded groups and marked processes after the grace; hang diagnosis: which rank is
stopped, stacks kept). It decides nothing: orchestrator.supervise does. Cancel and status work from another
process too, through the AgentRecords in the run dir.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Iterator

from orchestrator.core.jobplan import LaunchPlan
from orchestrator.core.leases import lease_request
from launchers.base import container_problems, ensure_open_files, record_container, run_dir_logs, status_from_nodes
from orchestrator.node.agent import MODULE as AGENT_MODULE, agent_argv
from orchestrator.node.heartbeat import parse_forwarded
from orchestrator.node.proctools import marked, signal_group, signal_pids
from orchestrator.node.rundir import EXIT_MARK, RunDir, parse_exit_line
from orchestrator.events import Beat, Line, NodeEnded, drain, split_lines
from orchestrator.types import JobHandle, JobStatus, NodeCommand, Submission

GRACE_S = 5.0


class LocalLauncher:
    kind = "local"

    def __init__(self, cluster=None, grace: float = GRACE_S):
        self.cluster = cluster
        self.grace = grace

    def prepare(self, plan: LaunchPlan) -> Submission:
        nodes = tuple(NodeCommand(node_rank=n.node_rank, host="localhost",
                                  argv=agent_argv(plan.python, plan.run_dir, node_rank=n.node_rank, watch_parent=True,
                                                  forward_heartbeats=True, grace=self.grace),
                                  env={}, secret_env=plan.secret_env) for n in plan.node_plans)
        extra = {"container": plan.container.to_dict(), "needed": list(plan.needed())} \
            if plan.container is not None else {}
        if plan.accelerator == "gpu":  # this machine's GPUs the job binds, judged before any node starts
            used = sorted({int(g) for n in plan.node_plans for g in n.env.get("CUDA_VISIBLE_DEVICES", "").split(",")
                           if g.strip().isdigit()})
            extra["gpu_check"] = {"policy": plan.health.gpu_check, "diag": plan.health.gpu_diag == "dcgm",
                                  "used": used or None, "xid_lookback_s": plan.health.xid_lookback_s}
        leases = [req for n in plan.node_plans if (req := lease_request(plan, n.node_rank)) is not None]
        if leases:  # the GPUs the agents will lease (a CPU-only local job leases nothing: it takes a free port)
            extra["leases"] = leases
        return Submission(kind=self.kind, run_dir=plan.run_dir, nodes=nodes, extra=extra)

    def submit(self, submission: Submission, run_dir: RunDir, cancel: threading.Event | None = None) -> "LocalJob":
        """Starts every node agent at once (nothing to cancel part-way: the supervisor stops them). A container job
        first checks this machine for it (runtime, image, mounts, the stack in the image): PreflightError, nothing
        started."""
        raised = ensure_open_files(len(submission.nodes), "a local job")
        if raised:
            import sys
            print(f"orchestrate: {raised}", file=sys.stderr)
        if submission.extra.get("leases"):  # GPUs another job leases: LeasesBusy (the api waits), nothing started
            from orchestrator.core.leases import Lock, busy_error_text
            from orchestrator.errors import LeasesBusy
            from orchestrator.node.lease import held
            busy = [b for req in submission.extra["leases"]
                    if (b := held([Lock.from_list(x) for x in req["locks"]], req["host"])) is not None]
            if busy:
                raise LeasesBusy(busy, busy_error_text(busy))
        if submission.extra.get("gpu_check"):
            gpu_preflight(submission.extra["gpu_check"], run_dir)
        if submission.extra.get("container"):
            from orchestrator.core.container import ContainerPlan
            from orchestrator.errors import PreflightError
            from orchestrator.node.containers import preflight
            cp = ContainerPlan.from_dict(submission.extra["container"])
            checks = {"localhost": preflight(cp, submission.extra.get("needed") or ())}
            problems = container_problems(cp.image, checks)
            if problems:
                raise PreflightError(problems)
            record_container(run_dir, submission.extra["container"], checks)
        return LocalJob(submission, run_dir, self.grace)

    def status(self, handle: JobHandle, run_dir: RunDir) -> JobStatus:
        from orchestrator.node.ops import node_status
        return status_from_nodes(node_status(run_dir, None))

    def cancel(self, handle: JobHandle, run_dir: RunDir) -> None:
        from orchestrator.node.ops import kill_node
        kill_node(run_dir, None, self.grace)

    def logs(self, handle: JobHandle, run_dir: RunDir, node: int | None = None) -> Iterator[str]:
        return run_dir_logs(run_dir, node)


class LocalJob:
    """A running local job: `events`, `stop`, `stopped_ranks` for the supervisor."""

    decides_hangs_on_nodes = False

    def __init__(self, submission: Submission, run_dir: RunDir, grace: float):
        self.rd, self.grace = run_dir, grace  # the agents' own TERM -> KILL grace (Running.grace)
        self.q: queue.Queue = queue.Queue()
        self.nodes = {n.node_rank: n.host for n in submission.nodes}
        self.procs: dict[int, subprocess.Popen | ForkedAgent] = {}
        self._threads: list[threading.Thread] = []
        run_dir.mkdir(RunDir.LOGS)
        # Forked from this process when it is single-threaded and runs the agent's own interpreter (no Python start
        # and no imports per node: ~50 ms of a 2-node submit's dispatch); else started as a program of its own.
        fork = threading.active_count() == 1 and all(forkable(n.argv) for n in submission.nodes)
        for node in submission.nodes:
            try:
                proc: subprocess.Popen | ForkedAgent = ForkedAgent(list(node.argv[3:])) if fork else subprocess.Popen(
                    list(node.argv), env=dict(os.environ), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True)
            except OSError:
                self.stop("start failed", grace)  # the agents already started go too
                raise
            self.procs[node.node_rank] = proc
        for rank, proc in self.procs.items():  # (after every fork: a forked agent inherits no thread of ours)
            t = threading.Thread(target=self._pump, args=(rank, proc), daemon=True, name=f"local-node{rank}")
            t.start()
            self._threads.append(t)
        agents = {r: p.pid for r, p in self.procs.items()}
        self.handle = JobHandle(uri=f"local://{run_dir.root.name}", data={"run_dir": str(run_dir.root),
                                                                          "agents": agents})

    def _pump(self, rank: int, proc: subprocess.Popen | ForkedAgent) -> None:
        """Node output -> the log file and events. A log file that cannot be written (disk full) does not stop the
        stream: the lines still reach the supervisor (and the terminal), and the problem is said once."""
        assert proc.stdout is not None
        log = _LogFile(self.rd.log(rank), lambda msg: self.q.put(Line(rank, msg)))
        pending = b""
        printed = None  # the exit record the agent printed because it could not write it (a full disk)
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            pending += chunk
            lines, pending = split_lines(pending)
            for line in lines:
                hb = parse_forwarded(line)
                if hb is not None:
                    self.q.put(Beat(hb))
                    continue
                printed = parse_exit_line(line) or printed
                if printed is not None and line.startswith(EXIT_MARK):
                    continue
                log.write(line)
                self.q.put(Line(rank, line))
        if pending.strip():
            log.write(pending.decode(errors="replace"))
            self.q.put(Line(rank, pending.decode(errors="replace")))
        log.close()
        proc.stdout.close()
        rc = proc.wait()
        rec = self.rd.exit(rank) or printed
        code = 128 - rc if rc < 0 else rc  # a signal, in the shell's convention (137 = SIGKILL), as on every backend
        self.q.put(NodeEnded(rank, self.nodes[rank], rec.returncode if rec else code, self.rd.log_tail(rank), rec,
                             "" if rec or rc == 0 else _no_record(rc)))

    def events(self, timeout: float) -> list:
        return drain(self.q, timeout)

    def stop(self, reason: str, grace: float, nodes: set[int] | None = None) -> None:
        """TERM the agents (each stops its launch, TERM then KILL after its own grace); KILL what any left behind."""
        targets = {r: p for r, p in self.procs.items() if (nodes is None or r in nodes) and p.poll() is None}
        for p in targets.values():
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

        def hard_kill() -> None:
            deadline = time.monotonic() + grace + 1.0
            while time.monotonic() < deadline and any(p.poll() is None for p in targets.values()):
                time.sleep(0.05)
            for r in targets:
                rec = self.rd.agent(r)
                if rec is None:
                    continue
                for g in rec.groups():
                    signal_group(g, signal.SIGKILL)
                if rec.token:
                    signal_pids(marked(rec.token), signal.SIGKILL)
        threading.Thread(target=hard_kill, daemon=True).start()

    def stopped_ranks(self, stacks: bool = True) -> dict[int, int]:
        from orchestrator.node.ops import keep_stacks, stopped_ranks
        pids, stopped = stopped_ranks(self.rd)
        if pids and stacks:
            keep_stacks(self.rd, pids, set(stopped))
        return stopped

    def close(self) -> None:
        for t in self._threads:
            t.join(timeout=5)


AGENT_COMM = b"orch-node-agent"  # a forked agent's process name (15 bytes: the kernel's limit)


def forkable(argv) -> bool:
    """Whether a node agent's argv runs this very interpreter's agent module (then it can be forked from here)."""
    import sys
    return len(argv) >= 3 and argv[0] == sys.executable and tuple(argv[1:3]) == ("-m", AGENT_MODULE)


class ForkedAgent:
    """A node agent forked from this process, with what `subprocess.Popen(argv, stdin=DEVNULL, stdout=PIPE,
    stderr=STDOUT, start_new_session=True)` gives (pid, stdout, poll, wait, send_signal), minus the Python start and
    the imports the new interpreter would pay. Only forked from a single-threaded process (LocalJob), so the child
    holds no lock another thread had; it runs `orchestrator.node.agent.main(args)` on fresh standard streams and
    leaves with os._exit (as `python -m orchestrator.node` does). Every fd Python or sqlite opened is close-on-exec,
    and the agent starts its launch with close_fds: nothing of this process reaches the ranks."""

    def __init__(self, args: list[str]):
        import sys
        r, w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        for stream in (sys.stdout, sys.stderr):  # what is buffered here must not be written twice
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        pid = os.fork()
        if pid == 0:
            _run_forked_agent(args, null, w, r)  # never returns
        os.close(w)
        os.close(null)
        self.pid, self.returncode = pid, None
        self.stdout = open(r, "rb")  # (a BufferedReader: read1, as Popen's)

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        while True:
            rc = self._reap(0)
            if rc is not None:
                return rc
            time.sleep(0.01)  # (another thread is reaping it)

    def _reap(self, flags: int) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped by the other thread's call: its returncode comes
            return self.returncode
        except InterruptedError:
            return None
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


def _run_forked_agent(args: list[str], null: int, w: int, r: int) -> None:
    """In the forked child: a session of its own, stdin /dev/null, stdout and stderr the pipe, the default signal
    dispositions this process may have changed; then the agent; then os._exit with its exit code."""
    import gc
    import io
    import sys
    code = 1
    try:
        gc.freeze()  # this process's objects stay as they are: none is finalized in the child
        os.setsid()
        os.close(r)
        os.dup2(null, 0)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(null)
        os.close(w)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        try:  # its command line stays the submit's (ps); its name says what it is (top, pgrep, ps -o comm)
            import ctypes
            ctypes.CDLL(None).prctl(15, ctypes.c_char_p(AGENT_COMM), 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        from orchestrator.node.agent import main
        code = main(args)
    except SystemExit as e:  # (argparse)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must never return into the submitter's code
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _no_record(rc: int) -> str:
    return (f"the node agent ended ({'signal ' + signal.Signals(-rc).name if rc < 0 else f'exit {rc}'}) without "
            "an exit record: it was killed or crashed") if rc else ""


class _LogFile:
    """Append-only node log that survives a full disk: writes resume when space is back; said once per outage."""

    def __init__(self, path, say):
        self.path, self.say, self.fh, self.failing = path, say, None, False
        try:
            self.fh = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab", buffering=0)
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if not self.failing:
            self.failing = True
            what = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            self.say(f"orchestrate: cannot write {self.path}: {what}; output keeps streaming here")

    def write(self, line: str) -> None:
        if self.fh is None:
            return
        try:
            self.fh.write(line.encode() + b"\n")
            self.failing = False
        except OSError as e:
            self._fail(e)

    def close(self) -> None:
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass


def gpu_preflight(want: dict, run_dir: RunDir) -> None:
    """This machine's GPUs that a local job binds, judged by the one set of rules (orchestrator.core.gpuhealth) under
    health.gpu_check: a refusal (fail, or exclude_host: one machine has no spare) is a PreflightError naming GPU,
    field and value; warn prints the findings and the job starts. Recorded in RUN_DIR/gpu_health.json."""
    import sys
    from orchestrator.core.gpuhealth import judge, kernel_log_note, verdict
    from orchestrator.errors import PreflightError, Problem
    from orchestrator.node import gpus
    used = tuple(want["used"]) if want.get("used") else None
    health = gpus.health(diag=bool(want.get("diag")))
    findings = judge("localhost", health, used, bool(want.get("diag")), float(want.get("xid_lookback_s") or 0))
    refused, warned, excluded = verdict(findings, str(want.get("policy") or "fail"))
    note = kernel_log_note("localhost", health)
    record = {"findings": [f.text() for f in findings], "excluded": bool(excluded)}
    run_dir.write_json("gpu_health.json", {"localhost": record | ({"note": note} if note else {})})
    if note:
        print(f"orchestrate: warning: GPU health: {note}", file=sys.stderr)
    bad = refused + [f for f in warned if f.host in excluded]
    if bad:
        raise PreflightError([Problem("localhost", f.text()) for f in bad])
    for f in warned:
        print(f"orchestrate: warning: GPU health (health.gpu_check: warn): localhost: {f.text()}", file=sys.stderr)

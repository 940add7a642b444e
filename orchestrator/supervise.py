"""THE supervision policy, the same for every backend (local, SSH, SLURM) and for every attempt of a job.

Backends only observe and report (`Running.events()`: output lines, heartbeat records, a node's end with its exit
record and last lines, a lost node, the scheduler's verdict) and act when told (`Running.stop`, `stopped_ranks`).
`Supervisor.run` decides: fail fast (the first node that fails makes every other node stop), hang (a rank silent
past its limit: the nodes keep every rank's evidence, and the one analysis, core.hangs, names the culprit: the ranks
that never entered the collective where the job stopped; without evidence a rank found stopped, else the longest
silent, `HealthMonitor.culprit`), cancel
(Ctrl-C, `orchestrate cancel`), and then `judge` names the outcome and its root cause: among the nodes that failed on
their own (before our teardown), the earliest by the agents' exit times, unless its log only shows a dead peer and
another's does not. `RestartPolicy` decides whether a failed attempt is restarted: one budget
(`health.max_restarts`) and one crash-loop rule (a restart that made no progress is not repeated), used by the
submitter's restart loop and by the SLURM task's requeue alike. Inside a SLURM allocation the node agents apply
the same HealthMonitor rules to the shared heartbeats (orchestrator.node.agent).
"""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.core.hangs import culprit_host
from orchestrator.core.health import HealthMonitor
from orchestrator.core.jobplan import LaunchPlan
from orchestrator.events import Beat, Line, NodeEnded, Running, SchedulerEnd
from orchestrator.node.rundir import AttemptRecord, RunDir
from orchestrator.types import JobResult, JobState, NodeExit

# ------------------------------------------------------------------------------------------------ root cause

_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
_EXC = re.compile(r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)"
                  r"(?::.*)?)$", re.MULTILINE)
_LAUNCHER_NOISE = ("ChildFailedError", "SignalException")
# Log lines that say a rank died because a PEER went away (a victim, not the root cause of a failure).
PEER_HINTS = ("Connection reset by peer", "Connection closed by peer", "connectFullMesh", "Broken pipe",
              "Socket closed", "ProcessGroupGloo", "recvBytes", "sendBytes")
STOPPED_BY_US = 0.2  # a node that ended this long after our teardown began was ended by it, not on its own


def peer_victim(tail: str) -> bool:
    return any(h in tail for h in PEER_HINTS)


def last_exception(text: str) -> tuple[int | None, str] | None:
    """The last Python exception line a rank printed (`[rank1]: ValueError: ...`), launcher noise skipped."""
    found = [(m.group(1), m.group(2).strip()) for m in _EXC.finditer(text)]
    found = [(r, e) for r, e in found if not any(n in e for n in _LAUNCHER_NOISE)]
    if not found:
        return None
    r, e = found[-1]
    return (int(r) if r is not None else None), e


def culprit_rank(stalls: list, stopped: dict[int, int]) -> int:
    """The rank a hang verdict names (HealthMonitor.culprit's choice): a stalled rank found stopped, else the lowest
    stopped one, else the longest silent."""
    for x in stalls:
        if x.rank in stopped:
            return x.rank
    return min(stopped) if stopped else stalls[0].rank


def describe_code(code: int | None) -> str:
    if code is None:
        return "unknown exit"
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            return f"signal {signal.Signals(num).name} (exit {code})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def root_cause_text(end: NodeEnded) -> str:
    """`node 1 (host) failed: rank 1 died of SIGKILL (exit -9) ...; node exit code 137 | rank 1: ValueError: ...`"""
    who = f"node {end.node} ({end.host or '?'})"
    if end.lost and end.record is None:
        return f"{who} failed: {end.lost}"
    tail = end.tail or ""
    rec = end.record
    detail = describe_code(end.returncode)
    if rec is not None and rec.gpu_fault:  # the node agent's GPU watch ended it (orchestrator.node.gpuwatch)
        return f"{who} failed: GPU watch: {rec.gpu_fault}"
    if rec is not None and rec.rank_death:
        detail = f"{rec.rank_death.replace(' before finishing', '')}; node {describe_code(end.returncode)}"
    else:
        rank, code = _RANK.findall(tail), _EXITCODE.findall(tail)
        if rank:
            rc = int(code[0]) if code else None
            how = ("died of " + describe_code(rc)) if rc is not None and rc < 0 else describe_code(rc)
            detail = f"rank {rank[0]} {how}; node {describe_code(end.returncode)}"
    exc = last_exception(tail)
    if exc is not None:
        r, e = exc
        return f"{who} failed: {detail}" + (f" | rank {r}: " if r is not None else " | ") + e[:300]
    last = [ln for ln in tail.splitlines() if ln.strip() and not ln.strip().startswith(("=", "-", "orchestrate"))][-3:]
    return f"{who} failed: {detail}" + (" | last lines: " + " / ".join(s.strip()[:200] for s in last) if last else "")


def failed(end: NodeEnded) -> bool:
    return bool(end.lost) or end.returncode not in (0, None) or (end.record is not None and end.record.returncode != 0)


def pick_failed(candidates: list[NodeEnded]) -> NodeEnded:
    """The earliest failure by the agents' own exit times (arrival order where a node left none), unless its log
    only shows a dead peer and another candidate's does not."""
    order = {id(c): i for i, c in enumerate(candidates)}
    ordered = sorted(candidates, key=lambda n: (n.record.time if n.record and n.record.time else float("inf"),
                                                order[id(n)]))
    first = ordered[0]
    if peer_victim(first.tail):
        for other in ordered[1:]:
            if not peer_victim(other.tail):
                return other
    return first


def stopped_by_us(end: NodeEnded, torn_down_at: float | None) -> bool:
    """A node that ended because our teardown stopped it (a victim, never the root cause): its agent was told to stop
    (a stop reason and no rank of its own died), or it ended well after the teardown began."""
    if torn_down_at is None or end.record is None or end.record.rank_death or not end.record.time:
        return False
    if end.record.stop_reason:  # told to stop: by our teardown only if that was after it began (1 s for clocks)
        return end.record.time >= torn_down_at - 1.0
    return end.record.time > torn_down_at + STOPPED_BY_US


GPU_REFUSAL = "PreflightError: GPU health"  # how a node agent refuses a node whose GPUs failed the health check


def culprit_of(end: NodeEnded) -> str:
    """How a failed node's end is attributable to its host: lost (gone, no record), health (its agent refused its
    GPUs, or its GPU watch ended it), crash (a rank of it failed)."""
    if end.lost and end.record is None:
        return "lost"
    gpu_fault = end.record is not None and end.record.gpu_fault  # (the GPU watch: a health check during the job)
    return "health" if gpu_fault or GPU_REFUSAL in (end.tail or "") else "crash"


def node_end(e: NodeEnded, torn_down_at: float | None, root: NodeEnded | None, hang_node: int | None
             ) -> tuple[str, str]:
    """(end, note) of one node for the record (types.NODE_ENDS): what happened to IT, in agreement with the cause."""
    rec = e.record
    if e is root:
        return "failed", (rec.note() if rec and (rec.rank_death or rec.gpu_fault) else e.lost or "")
    if rec is None and e.lost and e.returncode is None:
        return "lost", e.lost
    if rec is not None and rec.hang:
        return "hung", rec.hang
    if rec is not None and rec.stop_reason and torn_down_at is not None and \
            (stopped_by_us(e, torn_down_at) or not failed(e)):
        return ("hung" if e.node == hang_node else "stopped"), rec.stop_reason
    if rec is not None and (rec.stop_reason or rec.signal == signal.SIGTERM) and not rec.rank_death \
            and root is not None and root.record is not None and rec.time and root.record.time \
            and rec.time >= root.record.time:
        # told to stop (or its launch TERMed from outside) after the cause's node had ended, no rank of its own died:
        # the scheduler's teardown (SLURM's --kill-on-bad-exit), which can come seconds before the supervisor hears
        # of any end (at the job's end). It TERMs every process of the step at once: the launch may die of it before
        # its agent's own TERM arrives, and the agent then leaves no stop reason.
        return "stopped", rec.stop_reason or "SIGTERM from outside (the scheduler's teardown)"
    if failed(e):
        return "failed", (rec.rank_death if rec and rec.rank_death else e.lost or "")
    if rec is not None and rec.preempted:
        return "preempted", rec.note()
    return "done", rec.note() if rec is not None else ""


def judge(ends: dict[int, NodeEnded], *, torn_down_at: float | None, hang: str | None, cancel: str | None,
          scheduler: SchedulerEnd | None = None, max_step: int | None = None, hang_host: str = "",
          straggler: str | None = None, straggler_host: str = "", hang_node: int | None = None) -> JobResult:
    """The outcome of one attempt. Pure: what ended how, when we began tearing down, and why; for a failure, the host
    it is attributable to (`hang_host`: the hung rank's, named by the caller), which the restart policy may exclude.
    Each node's end (`node_end`) agrees with the cause: the root cause's node failed, the ones torn down stopped."""
    def nodes_of(root: NodeEnded | None = None, hung_on: int | None = None) -> tuple[NodeExit, ...]:
        out = []
        for e in sorted(ends.values(), key=lambda e: e.node):
            code = e.record.returncode if e.record else e.returncode
            end, note = node_end(e, torn_down_at, root, hung_on)
            out.append(NodeExit(node_rank=e.node, host=e.host, returncode=code,
                                signal=e.record.signal if e.record else None, log_tail=e.tail, end=end, note=note))
        return tuple(out)
    nodes = nodes_of()
    if cancel:
        return JobResult(JobState.CANCELLED, 130, cancel, nodes, max_step)
    node_hangs = sorted((e.record.hang for e in ends.values() if e.record and e.record.hang),
                        key=lambda text: "is stopped" not in text)
    if not hang and node_hangs:  # a node agent judged the hang (SLURM): its node holds the culprit when it says so
        hang = node_hangs[0]
        hang_host = next((e.host for e in ends.values() if e.record and e.record.hang == hang and
                          "is stopped" in hang), "")
        if not hang_host:  # the analysis named a culprit rank (one that never entered the collective): its host
            hang_host = culprit_host(hang)
    if hang:
        return JobResult(JobState.FAILED, 124, hang, nodes_of(hung_on=hang_node), max_step, hung=True,
                         culprit_host=hang_host,
                         culprit_kind="hang" if hang_host else "")
    if straggler:  # stopped by us to take the straggler's host out (health.straggler.action: restart_without)
        return JobResult(JobState.FAILED, 1, straggler, nodes, max_step, culprit_host=straggler_host,
                         culprit_kind="straggler" if straggler_host else "")
    if scheduler is not None and scheduler.state == JobState.CANCELLED:
        return JobResult(JobState.CANCELLED, 130, scheduler.reason, nodes, max_step)
    bad = [e for e in ends.values() if failed(e)]
    if not bad:
        if scheduler is not None and scheduler.state == JobState.FAILED:
            return JobResult(JobState.FAILED, 1, scheduler.reason, nodes, max_step)
        preempted = [e for e in ends.values() if e.record is not None and e.record.preempted]
        if preempted and (scheduler is None or scheduler.state != JobState.COMPLETED):
            why = "preempted: the ranks saved a checkpoint on a preemption signal and stopped"
            return JobResult(JobState.FAILED, 1, (scheduler.reason + "; " if scheduler and scheduler.reason else "")
                             + why, nodes, max_step)
        return JobResult(JobState.COMPLETED, 0, "", nodes, max_step)
    own = [e for e in bad if not stopped_by_us(e, torn_down_at)]
    gpu = [e for e in bad if e.record is not None and e.record.gpu_fault]  # its own finding, whenever it ended
    root = pick_failed(gpu or own or sorted(bad, key=lambda e: e.node))
    text = root_cause_text(root)
    if scheduler is not None and scheduler.reason and scheduler.state == JobState.FAILED and root.lost:
        text = f"{scheduler.reason}; {text}"
    code = (root.record.returncode if root.record else root.returncode) or 1
    host = root.host if root.host not in ("", "?") else ""  # ("?": a backend that could not tell; nothing to exclude)
    return JobResult(JobState.FAILED, code if code > 0 else 1, text, nodes_of(root), max_step, culprit_host=host,
                     culprit_kind=culprit_of(root) if host else "")


# ------------------------------------------------------------------------------------------------ stragglers

class StragglerLog:
    """The supervisor's straggler bookkeeping for one attempt: asks the HealthMonitor (at most every CHECK_S), names
    each straggler once, and keeps RUN_DIR/stragglers.json (the verdicts of every attempt, and each rank's current
    evidence for `status`'s column) up to date every SAVE_S."""

    CHECK_S, SAVE_S = 2.0, 10.0

    def __init__(self, plan: LaunchPlan, attempt: int):
        self.rd = RunDir(plan.run_dir) if getattr(plan, "run_dir", "") else None
        spec = getattr(plan.health, "straggler", None)
        self.action = getattr(spec, "action", "warn")
        self.attempt = attempt
        self.named: set[int] = set()
        self.next_check = self.next_save = 0.0
        self.data = (self.rd.stragglers() if self.rd else {}) or {"named": []}

    def judge(self, monitor: HealthMonitor, now: float, host_of: Callable[[int], str] = lambda _r: "") -> list:
        """The stragglers not named before, each with its host as the job names it (`host_of(rank)`, else the host
        its heartbeats give)."""
        if now < self.next_check:
            return []
        self.next_check = now + self.CHECK_S
        new = [dataclasses.replace(s, host=host_of(s.rank) or s.host) for s in monitor.stragglers()
               if s.rank not in self.named]
        for s in new:
            self.named.add(s.rank)
            self.data.setdefault("named", []).append(dict(s.to_dict(), t=now, attempt=self.attempt,
                                                          action=self.action))
        if new or now >= self.next_save:
            self.save(monitor, now)
        return new

    def save(self, monitor: HealthMonitor, now: float) -> None:
        self.next_save = now + self.SAVE_S
        evidence = monitor.evidence()
        if self.rd is None or not (evidence or self.data.get("named")):
            return
        self.data.update(evidence={str(r): round(v, 6) for r, v in evidence.items()}, t=now,
                         window=monitor.straggler_window, factor=monitor.straggler_factor,
                         arrival={str(r): round(v, 6) for r, v in monitor.arrival_evidence().items()},
                         wait_share={str(r): round(v, 4) for r, v in sorted(monitor.hold_shares().items())})
        try:
            self.rd.write_json(RunDir.STRAGGLERS, self.data)
        except OSError:
            pass  # (a full disk: the verdict was said in the log; status lacks the column)


# ------------------------------------------------------------------------------------------------ the supervisor

@dataclass
class Supervisor:
    """Runs one attempt of a job to its end. `cancel` (set from a signal handler or another thread) carries the
    reason of a user's cancel; Ctrl-C raising KeyboardInterrupt in the loop counts as one too. `detach` stops
    watching and leaves the job running (SLURM runs it on without the submitter): run() returns a RUNNING result;
    honoured only where the nodes judge hangs themselves (`Running.decides_hangs_on_nodes`), else ignored."""

    plan: LaunchPlan
    on_line: Callable[[int, str], None] | None = None
    on_beat: Callable[[dict], None] | None = None
    grace: float | None = None  # cancel / hang: TERM, then KILL after this (default: the backend's)
    failfast_grace: float = 1.0  # a node failed: the others cannot finish a collective anyway
    lost_after: float = 15.0  # after a teardown, a node that has not ended this much past the grace is lost
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = "cancelled"
    detach: threading.Event = field(default_factory=threading.Event)
    detach_reason: str = ""
    attempt: int = 0  # which attempt run() supervises (the api sets it; recorded with straggler verdicts)
    notifies: bool = False  # a notify: block's events come from this process: losing its output does not detach it

    def request_cancel(self, reason: str) -> None:
        if not self.cancel.is_set():  # the first reason is the cause (a Ctrl-C, then the hang-up it led to)
            self.cancel_reason = reason
        self.cancel.set()

    def request_detach(self, reason: str) -> None:
        if not self.detach.is_set():
            self.detach_reason = reason
        self.detach.set()

    def run(self, job: Running) -> JobResult:
        monitor = HealthMonitor(self.plan.health, self.plan.world_size, started=time.time())
        grace = self.grace if self.grace is not None else float(getattr(job, "grace", 5.0))
        every = float(self.plan.health.poll_interval)
        hang_margin = (self.plan.health.stall_timeout * 0.5 + 30.0) if job.decides_hangs_on_nodes else 0.0
        ends: dict[int, NodeEnded] = {}
        scheduler: SchedulerEnd | None = None
        torn_down_at: float | None = None
        teardown_mono: float | None = None
        hang: str | None = None
        hang_host = ""
        hang_node: int | None = None
        cancel: str | None = None
        next_check = 0.0
        straggler: str | None = None
        straggler_host = ""
        stragglers = StragglerLog(self.plan, self.attempt)
        rd = RunDir(self.plan.run_dir) if getattr(self.plan, "run_dir", "") else None

        def teardown(reason: str, grace: float, nodes: set[int] | None = None) -> None:
            nonlocal torn_down_at, teardown_mono
            if torn_down_at is None:
                torn_down_at, teardown_mono = time.time(), time.monotonic()
            job.stop(reason, grace, nodes)

        try:
            while len(ends) < len(job.nodes) and scheduler is None:
                try:
                    for ev in job.events(0.1):
                        if isinstance(ev, Line):
                            if self.on_line:
                                self.on_line(ev.node, ev.text)
                        elif isinstance(ev, Beat):  # (judged with the host as the job names it, not the rank's
                            rec = ev.record  # own hostname: "rank 1 on gpu02 hung", never the machine's name)
                            try:
                                host = self._host_of(job, int(rec["rank"]))
                            except (KeyError, TypeError, ValueError):
                                host = ""
                            monitor.feed(dict(rec, host=host) if host and host != rec.get("host") else rec,
                                         time.time())
                            if rec.get("event") == "tracking" and rd is not None:
                                rd.write_tracking(rec)  # the job's tracker run (rank 0 names it), for `status`
                            if self.on_beat:
                                self.on_beat(ev.record)
                        elif isinstance(ev, NodeEnded):
                            ends.setdefault(ev.node, ev)
                            if failed(ev) and torn_down_at is None and not cancel and not hang:
                                teardown(f"node {ev.node} failed", self.failfast_grace, set(job.nodes) - set(ends))
                        elif isinstance(ev, SchedulerEnd):
                            scheduler = ev
                    now = time.time()
                    if not getattr(job, "started", True):  # queued (SLURM): no rank can be late yet
                        monitor = HealthMonitor(self.plan.health, self.plan.world_size, started=now)
                    if self.cancel.is_set() and not cancel:
                        cancel = self.cancel_reason
                        teardown(cancel, grace, set(job.nodes) - set(ends))
                    if self.detach.is_set() and job.decides_hangs_on_nodes and torn_down_at is None and \
                            len(ends) < len(job.nodes) and scheduler is None:
                        return JobResult(JobState.RUNNING, 0, self.detach_reason)
                    if torn_down_at is None and now >= next_check:
                        next_check = now + every
                        stalls = [s for s in monitor.stalls(now) if s.silent_s > s.limit_s + hang_margin]
                        if stalls:
                            asked = time.time()
                            stopped = job.stopped_ranks(self.plan.health.stack_dumps)
                            hang, rank = monitor.culprit(stalls, stopped, now), culprit_rank(stalls, stopped)
                            diag = self._diagnose(asked) if self.plan.health.stack_dumps else None
                            if diag is not None and diag.culprits:  # the evidence names the culprit (core.hangs)
                                rank = diag.culprits[0]
                            hang_node = rank // max(1, self.plan.procs_per_node)
                            hang_host = self._host_of(job, rank)
                            if diag is not None and diag.culprits:
                                hang = diag.root_cause(hang_host)
                            if self.plan.health.stack_dumps:
                                hang += "; stacks in RUN_DIR/stacks/" + (" on each host" if len(set(job.nodes.values()))
                                                                         > 1 else "")
                            if self.on_line:
                                self.on_line(hang_node, f"orchestrate: {hang}")
                            teardown("hang: " + hang, grace, set(job.nodes) - set(ends))
                        for slow in stragglers.judge(monitor, now, lambda r: self._host_of(job, r)):
                            text = slow.describe()  # newly named: said once each, recorded in the run dir
                            if self.on_line:
                                self.on_line(slow.rank // max(1, self.plan.procs_per_node), f"orchestrate: {text}")
                            if stragglers.action == "restart_without" and straggler is None and torn_down_at is None:
                                straggler, straggler_host = text, slow.host
                                teardown("straggler: " + text, grace, set(job.nodes) - set(ends))
                    if teardown_mono is not None and time.monotonic() - teardown_mono > grace + self.lost_after:
                        for r, host in job.nodes.items():
                            ends.setdefault(r, NodeEnded(r, host, None, lost="did not end after the teardown "
                                                         f"({grace + self.lost_after:.0f} s): host unreachable?"))
                except KeyboardInterrupt:
                    self.request_cancel("interrupted (Ctrl-C) on the submit host")
        except BaseException:  # our own failure must not leave the nodes running
            try:
                job.stop("the supervisor failed", grace)
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            job.close()
        stragglers.save(monitor, time.time())
        max_step = max((st.step for st in monitor.snapshot()), default=None)
        result = judge(ends, torn_down_at=torn_down_at, hang=hang, cancel=cancel, scheduler=scheduler,
                       max_step=max_step, hang_host=hang_host, straggler=straggler, straggler_host=straggler_host,
                       hang_node=hang_node)
        return dataclasses.replace(result, teardown_at=torn_down_at)

    def _diagnose(self, since: float):
        """The hang analysis (core.hangs) over the evidence the nodes just kept (node.hangevidence), or None."""
        if not getattr(self.plan, "run_dir", ""):
            return None
        from orchestrator.node.hangevidence import diagnose_run
        try:
            return diagnose_run(RunDir(self.plan.run_dir), self.plan.world_size, since=since - 1.0)
        except Exception:  # noqa: BLE001 - the analysis must never keep a hung job from being torn down
            return None

    def _host_of(self, job: Running, rank: int) -> str:
        """The host of a global rank's node, as the job names it (the cluster file's host, SLURM's node)."""
        node = rank // max(1, self.plan.procs_per_node)
        return job.nodes.get(node) or (self.plan.node(node).host if node < len(self.plan.node_plans) else "")


# ------------------------------------------------------------------------------------------------ restarts

def spares_matter(bad_hosts: dict[str, str]) -> bool:
    """Whether another host could fix what the pre-flight found (`bad_hosts` {host: why}): not when the main port is
    taken (the job's port), nor when two or more hosts fail the same way (a missing image or mount: the job's)."""
    if any("main port" in why for why in bad_hosts.values()):
        return False
    whys = [why.replace(host, "HOST") for host, why in bad_hosts.items()]
    return not (len(whys) > 1 and len(set(whys)) < len(whys))


EXCLUDE_AT_ONCE = ("lost", "health", "straggler")  # a host that did this is taken out at the first time
EXCLUDE_IF_REPEATED = ("crash", "hang")  # ... and one whose rank crashed or hung twice in a row


@dataclass(frozen=True)
class Decision:
    """What RestartPolicy decided after an attempt: restart or stop, why, and the host to take out first."""

    restart: bool
    why: str
    exclude: str = ""


@dataclass(frozen=True)
class RestartPolicy:
    """One restart budget, one crash-loop rule and one bad-host rule, for every backend and for SLURM requeues alike.

    - At most `max_restarts` restarts (health.max_restarts).
    - A restart is not repeated when the attempt after the previous restart made no progress (the furthest global
      step did not move), unless a host was replaced since (a new set of hosts is a new configuration).
    - A failure attributable to a host (JobResult.culprit_host / culprit_kind) takes that host out of the job where
      the backend can replace it (`spares`: hosts left to take its place; None: this backend cannot replace hosts,
      the local one): at once when it was lost, failed its GPU health check or was a straggler under
      `restart_without`; when its rank crashed or hung, the second time in a row on that host. No spare left: stop,
      saying so (docs/CONTRACT.md "Bad nodes")."""

    max_restarts: int

    def decide(self, history: list[AttemptRecord], step: int | None, counted: int = 0, culprit_host: str = "",
               culprit_kind: str = "", spares: int | None = None) -> Decision:
        """`counted`: restarts known from elsewhere (SLURM_RESTART_COUNT), whichever is more wins."""
        done = [h for h in history if h.decision == "restart"]
        n = max(len(done), counted)
        exclude = ""
        if n >= self.max_restarts:  # (first: without a restart to come, no spare is the question)
            return Decision(False, f"restart budget spent ({n} of health.max_restarts={self.max_restarts})"
                            if self.max_restarts else "restarts are off (health.max_restarts=0)")
        if culprit_host and spares is not None:
            repeated = bool(history) and history[-1].host == culprit_host and history[-1].kind in EXCLUDE_IF_REPEATED
            if culprit_kind in EXCLUDE_AT_ONCE or (culprit_kind in EXCLUDE_IF_REPEATED and repeated):
                if spares <= 0:
                    return Decision(False, f"{culprit_host} is bad ({culprit_kind}"
                                           f"{', again' if repeated else ''}) and no spare host is left to replace it")
                exclude = culprit_host
        replaced = bool(exclude) or (bool(done) and bool(done[-1].exclude))
        if done and not replaced and (step is None or (done[-1].step is not None and step <= done[-1].step)):
            return Decision(False, f"crash loop: no progress since the last restart (global step {step}, was "
                                   f"{done[-1].step}); not restarting")
        if exclude:
            return Decision(True, f"restart {n + 1}/{self.max_restarts} without {exclude} ({culprit_kind}"
                                  f"{', twice in a row' if culprit_kind in EXCLUDE_IF_REPEATED else ''}), a spare "
                                  f"in its place, from the latest checkpoint (global step {step})", exclude)
        return Decision(True, f"restart {n + 1}/{self.max_restarts} from the latest checkpoint (global step {step})")

    def record(self, run_dir: RunDir, attempt: int, cause: str, *, by: str = "supervisor",
               slurm_job_id: str = "", counted: int = 0, culprit_host: str = "", culprit_kind: str = "",
               spares: int | None = None) -> Decision:
        """Decide after `attempt` ended because of `cause`, and append the decision to RUN_DIR/restarts.jsonl."""
        step = run_dir.furthest_step()
        d = self.decide(run_dir.attempts(), step, counted, culprit_host, culprit_kind, spares)
        try:
            run_dir.append_attempt(AttemptRecord(t=time.time(), attempt=attempt, decision="restart" if d.restart
                                                 else "stop", reason=f"{cause} -> {d.why}" if cause else d.why,
                                                 step=step, by=by, slurm_job_id=slurm_job_id, host=culprit_host,
                                                 kind=culprit_kind, exclude=d.exclude))
        except OSError:
            pass
        return d

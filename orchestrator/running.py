"""The run of a job, in the process that supervises it: the run dir written and the job recorded, each attempt
handed to its launcher and watched by the one Supervisor, the queue wait for leased hosts/GPUs (QUEUED), the re-plan
around a bad host, the restart loop of the one RestartPolicy, and the record of the end (outcome.json, the store).
A SLURM sweep's points are recorded and submitted here as one array job (`submit_array`).

Planning (what to run) is orchestrator.api's `prepare`; queries on recorded jobs from any process (status, reconcile,
cancel, logs) are orchestrator.records'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from orchestrator.api import Prepared, replan, spares_left, write_files
from orchestrator.errors import LeasesBusy, PreflightError, Problem, SubmitCancelled
from launchers import launcher_for
from orchestrator.node.rundir import AttemptRecord, RunDir, write_error
from orchestrator.supervise import RestartPolicy, Supervisor, spares_matter
from orchestrator.types import JobHandle, JobResult, JobState, exit_signal
from orchestrator.core.jobplan import LaunchPlan


def _record_new(prepared: Prepared, store, state: str = "PENDING") -> RunDir:
    """The job's run dir written (with its cluster.json) and its record created."""
    from orchestrator.core.spec import cluster_to_dict
    from orchestrator.store import StoreError, digest
    plan = prepared.plan
    rd = RunDir(plan.run_dir)
    fresh = not rd.root.exists()
    try:
        write_files(dict(prepared.files, **{RunDir.CLUSTER: json.dumps(cluster_to_dict(prepared.cluster), indent=2,
                                                                       sort_keys=True) + "\n"}), rd.root)
        store.create(job_id=plan.job_id, recipe=prepared.recipe.source,
                     recipe_digest=digest(prepared.files["recipe.yaml"]), cluster=prepared.cluster.name,
                     backend=prepared.cluster.kind, nodes=plan.nodes, world_size=plan.world_size, run_dir=str(rd.root),
                     state=state)
    except (OSError, StoreError) as e:  # (a full disk, a read-only home): refused, and no half-written run dir left
        if fresh:
            import shutil
            shutil.rmtree(rd.root, ignore_errors=True)
        raise PreflightError(Problem("", f"job {plan.job_id} not submitted: {_why_not_written(e)}")) from None
    return rd


def _why_not_written(e: Exception) -> str:
    from orchestrator.store import StoreError
    return e.one_line() if isinstance(e, StoreError) else f"cannot write the run dir: {write_error(e)}"


def submit(prepared: Prepared, *, on_line: Callable[[int, str], None] | None = None,
           on_beat: Callable[[dict], None] | None = None, on_event: Callable[[str, dict], None] | None = None,
           supervisor: Supervisor | None = None, wait: bool = True, adopt: JobHandle | None = None) -> JobResult:
    """Write the run dir, record the job, run it under the one Supervisor, restart by the one RestartPolicy, record
    the end. `supervisor` lets the caller keep a handle to cancel it (signal handlers). Hosts or GPUs leased by another
    job (LeasesBusy): the job waits QUEUED and tries again (`wait_for_leases`); `wait=False`: LeasesBusy is raised at
    once (the job recorded CANCELLED, nothing started). `adopt`: the first attempt was submitted already (a SLURM
    sweep's array task, `submit_array`: its run dir and record exist): it is watched, not submitted; a restart is a
    submission of its own. A run dir or record that cannot be written (a full disk): PreflightError, nothing left."""
    from orchestrator.store import JobStore, StoreError
    plan = prepared.plan
    try:
        store = JobStore()
    except StoreError as e:
        raise PreflightError(Problem("", f"job {plan.job_id} not submitted: {_why_not_written(e)}")) from None
    known = store.get(plan.job_id) if adopt is not None else None
    rd = RunDir(plan.run_dir) if known is not None and known.id == plan.job_id else _record_new(prepared, store)
    sup = supervisor or Supervisor(plan)
    sup.on_line, sup.on_beat = on_line or sup.on_line, on_beat or sup.on_beat
    notifier = _notifier(prepared, rd, sup, on_event)
    sup.notifies = notifier is not None

    def emit(kind: str, data: dict) -> None:
        if notifier is not None and kind == "running" and data.get("attempt") == 0:
            notifier.started(data.get("handle", ""))
        if on_event:
            on_event(kind, data)

    policy = RestartPolicy(plan.health.max_restarts)
    launcher = launcher_for(prepared.cluster)
    attempt = 0
    try:
        while True:
            if sup.cancel.is_set():  # cancelled between attempts (or before the first started)
                result = JobResult(JobState.CANCELLED, 130, sup.cancel_reason)
                break
            stamp = store.wake_stamp()  # a job of this store that ends during this try wakes the wait after it
            try:
                result = _run_once(prepared, launcher, sup, store, rd, attempt, emit,
                                   adopt=adopt if attempt == 0 else None)
                if lost_lease_race(result):  # an agent found its host/GPU taken after the look: wait again
                    raise LeasesBusy([], result.root_cause.split("LeaseBusy: ", 1)[-1].splitlines()[0])
            except LeasesBusy as e:
                if not wait:
                    if e.kept is not None:  # (SSH: the hosts' waiting agents end now)
                        e.kept.close()
                    why = f"not started: {e} (--no-wait)"
                    store.update(plan.job_id, JobState.CANCELLED, detail=why[:500], root_cause=why[:500],
                                 exit_code=e.exit_code, final=True)
                    raise
                wait_for_leases(prepared, sup, store, rd, e, emit, stamp)
                continue
            except PreflightError as e:  # hosts that cannot run the job: spares take their place before the start
                spares = spares_left(prepared) if e.bad_hosts else None
                if spares is None or spares < len(e.bad_hosts) or len(e.bad_hosts) < len({p.where for p in e.problems}):
                    if e.bad_hosts:
                        if spares is not None and len(e.bad_hosts) == len({p.where for p in e.problems}) and \
                                spares_matter(e.bad_hosts):
                            gone = ", ".join(sorted(e.bad_hosts))
                            e = PreflightError(e.problems + [Problem("ssh.hosts", f"no spare host left to replace "
                                                                                  f"{gone}")], source=e.source)
                        store.update(plan.job_id, JobState.FAILED, detail=str(e)[:500], root_cause=str(e)[:500],
                                     exit_code=e.exit_code)  # (the very line and code the submit prints and exits)
                        raise e from None
                    raise
                for host, why in e.bad_hosts.items():
                    rd.append_attempt(AttemptRecord(t=time.time(), attempt=attempt, decision="replace",
                                                    reason=f"pre-flight: {why} -> replaced by a spare before the start",
                                                    host=host, kind="preflight", exclude=host))
                    prepared = replan(prepared, host)
                plan = _replanned(prepared, rd, sup, emit, sorted(e.bad_hosts))
                launcher = launcher_for(prepared.cluster)  # (SLURM: the next allocation's --exclude is the cluster's)
                continue
            if result.state in (JobState.COMPLETED, JobState.CANCELLED, JobState.RUNNING) or sup.cancel.is_set():
                break  # RUNNING: detached, the backend runs it on (status / ls ask it and record its end)
            d = policy.record(rd, attempt, result.root_cause, counted=attempt, culprit_host=result.culprit_host,
                              culprit_kind=result.culprit_kind, spares=spares_left(prepared))
            why = d.why
            if not d.restart:
                if plan.health.max_restarts or "no spare host" in why:
                    result = dataclasses.replace(result, root_cause=f"{result.root_cause} ({why})")
                break
            attempt += 1
            if d.exclude:
                prepared = replan(prepared, d.exclude)
                plan = _replanned(prepared, rd, sup, emit, [d.exclude])
                launcher = launcher_for(prepared.cluster)
            store.update(plan.job_id, JobState.RESTARTING, detail=f"{why}: {result.root_cause}"[:2000],
                         restarts=restart_count(rd))
            if notifier is not None:
                notifier.attempts()
            if on_event:
                on_event("restart", {"job_id": plan.job_id, "restart": attempt,
                                     "max_restarts": plan.health.max_restarts, "reason": result.root_cause,
                                     "step": rd.furthest_step()})
    except LeasesBusy:  # --no-wait: recorded CANCELLED above, nothing started; the caller says it (exit 75)
        if notifier is not None:
            notifier.close()
        raise
    except BaseException as e:  # the supervisor itself failed: the job is not left RUNNING in the store
        why = f"the supervisor failed: {type(e).__name__}: {str(e)[:300]}"
        try:
            store.update(plan.job_id, JobState.FAILED, detail=why, root_cause=why, exit_code=1, final=True)
        except Exception:  # noqa: BLE001 - reconcile (ls/status) records it later
            pass
        if notifier is not None:
            notifier.finished(JobResult(JobState.FAILED, 1, why, restarts=restart_count(rd)))
            notifier.close()
        raise
    restarts = restart_count(rd)
    if result.state == JobState.RUNNING:  # detached: no end to record yet
        store.update(plan.job_id, JobState.RUNNING, detail=result.root_cause or None, restarts=restarts)
    else:
        record_end(store, rd, plan.job_id, result, restarts, on_event)
    result = dataclasses.replace(result, restarts=restarts)
    if notifier is not None:  # after the store has the end: a hook that asks `orchestrate status` sees it
        if result.state != JobState.RUNNING:
            notifier.finished(result)
        notifier.close()
    return result


def supervise_here(prepared: Prepared, *, signals: Callable[[Supervisor], Callable[[], Any] | None] | None = None,
                   supervisor: Supervisor | None = None, **kw) -> JobResult:
    """Run the prepared job to its end in this process, as its recorded supervisor (ORCHESTRATE_HOME/supervisors/
    <job>.pid: `cancel` from any process signals it): an attached `orchestrate submit`, a detached one's supervisor,
    and the Python API's `submit(detach=False)`. `signals(sup)` installs how this process is asked to cancel (it may
    return what puts the old handlers back); `kw` goes to `submit`. Files are created owner-only meanwhile."""
    from orchestrator.detach import forget_self, record_self
    job = prepared.plan.job_id
    mask = os.umask(0o077)
    record_self(job)
    sup = supervisor or Supervisor(prepared.plan)
    restore = signals(sup) if signals is not None else None
    try:
        return submit(prepared, supervisor=sup, **kw)
    finally:
        forget_self(job)
        if restore is not None:
            restore()
        os.umask(mask)


def submit_array(prepared: list[Prepared], *, parallel: int, name: str, folder: str, script: str,
                 cancel=None) -> tuple[str, list[JobHandle]]:
    """A sweep's points on SLURM as ONE array job (launchers.slurm SlurmLauncher.submit_array): every point's run dir
    written and its job recorded (PENDING) first, then one sbatch; each record gets its array task's handle. Nothing
    watches them here: each point's supervisor is `submit(..., adopt=handle)`. A cancel during the check, or a failed
    sbatch: every point recorded CANCELLED / FAILED with why, and the error raised."""
    from orchestrator.store import JobStore
    store = JobStore()
    rds = [_record_new(p, store) for p in prepared]
    launcher = launcher_for(prepared[0].cluster)
    subs = [launcher.prepare(replace(p.plan, submitter=submitter())) for p in prepared]
    try:
        array, handles = launcher.submit_array(subs, rds, parallel=parallel, name=name, folder=Path(folder),
                                               script=script, cancel=cancel)
    except BaseException as e:
        state, code = (JobState.CANCELLED, 130) if isinstance(e, (SubmitCancelled, KeyboardInterrupt)) else \
            (JobState.FAILED, 1)
        why = f"the sweep's array job was not submitted: {e}"[:500]
        for p in prepared:
            store.update(p.plan.job_id, state, detail=why, root_cause=why, exit_code=code, final=True)
        raise
    for p, rd, h in zip(prepared, rds, handles, strict=True):
        rd.write_json(RunDir.HANDLE, {"uri": h.uri, "data": h.data})
        store.update(p.plan.job_id, handle=h.uri)
    return array, handles


QUEUE_POLL_S = 3.0  # a QUEUED job looks again this often (docs/CONTRACT.md "Leases")
QUEUE_OWN_POLL_S = 30.0  # ... when its holders are live jobs of its own store (their end wakes it; a safety net)
END_RETRY_S = 60.0  # a full job store: the supervising process keeps trying to record the end this long


def outcome_record(result: JobResult, by: str) -> dict[str, Any]:
    """RUN_DIR/outcome.json of an ended attempt (RunDir docstring): the state, the exit code (128 + N: signal N, named
    in "signal"), the cause and each node's end as judged."""
    return {"state": str(result.state), "exit_code": result.returncode,
            "signal": exit_signal(result.returncode) if result.state == JobState.FAILED else None,
            "root_cause": result.root_cause, "by": by, "t": time.time(), "nodes": [n.to_dict() for n in result.nodes],
            "teardown_at": result.teardown_at}


def record_end(store, rd: RunDir, job: str, result: JobResult, restarts: int, on_event=None) -> None:
    """Record how the job ended: RUN_DIR/outcome.json (each node's end), then the store. A full disk never turns the
    end into something else: the store is retried for END_RETRY_S (said once; once it takes the end, an outcome.json
    that could not be written is written then), and when it still cannot take it the StoreFullError says the real
    end; `status` records it later from outcome.json (or the agents' exit records)."""
    from orchestrator.store import StoreFullError
    unwritten = rd.write_outcome(outcome_record(result, "supervisor"))
    fields = dict(detail=result.root_cause or None, exit_code=result.returncode, root_cause=result.root_cause or None,
                  restarts=restarts)
    try:
        store.update(job, result.state, **fields)
        return
    except StoreFullError as e:
        said = (f"ended {result.state} (exit {result.returncode}) but the job store cannot record it: "
                f"{e.one_line()}; trying again for {END_RETRY_S:.0f} s")
        if on_event:  # (a note is shown as "job JOB: LINE")
            on_event("note", {"job_id": job, "line": said})
        else:
            print(f"orchestrate: job {job} {said}", file=sys.stderr, flush=True)
    try:
        store.update(job, result.state, retry_s=END_RETRY_S, **fields)
        if unwritten is not None:  # there is space again: each node's end, which `status` shows, is kept too
            rd.write_outcome(outcome_record(result, "supervisor"))
    except StoreFullError as e:
        later = ("`orchestrate status` records it from the run dir once there is space" if unwritten is None else
                 f"its outcome could not be written either ({unwritten})")
        raise StoreFullError(f"job {job} ended {result.state} (exit {result.returncode}) but the job store could not "
                             f"record it: {e.one_line()}; {later}", e.path) from None


def submitter() -> str:
    """user@host of this process (a lease file names who holds it)."""
    import getpass
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def lost_lease_race(result: JobResult) -> bool:
    """An attempt that ended before anything started because a node agent found its lease taken (exit 75,
    `LeaseBusy:`): the job goes back to waiting, it has not failed."""
    from orchestrator.core.leases import EXIT_BUSY
    return (result.state == JobState.FAILED and result.returncode == EXIT_BUSY
            and "LeaseBusy: " in (result.root_cause or ""))


def queue_positions(records: list | None = None) -> dict[str, int]:
    """{job id: its place in this store's queue} for every QUEUED job whose submitter is alive: 1 + the queued jobs
    submitted before it that want an overlapping lease (core.leases.queue_position, FIFO by submit time)."""
    from orchestrator.core.leases import job_locks, queue_position
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    recs = JobStore().list(None) if records is None else records
    queued = []
    for rec in recs:
        if rec.state != JobState.QUEUED or (rec.id not in _WAITING and live_supervisor(rec.id) is None):
            continue
        try:
            plan = RunDir(rec.run_dir).read_plan()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        queued.append((rec.id, rec.created, job_locks(plan)))
    return {q[0]: queue_position(q[0], queued) for q in queued}


def queue_poll_s(store, busy: LeasesBusy) -> float:
    """How long a QUEUED job waits for its store to move before it looks again: QUEUE_POLL_S, or QUEUE_OWN_POLL_S when
    every lease it found busy is held by a job of its own store whose supervisor lives: that job's end moves the
    store's wake-up, and a try every few seconds meanwhile (staging, a probe on every host) only takes CPU from it."""
    from orchestrator.detach import live_supervisor
    jobs = {(b.get("holder") or {}).get("job") for b in busy.busy}
    if jobs and all(j and store.get(j) is not None and live_supervisor(j) is not None for j in jobs):
        return QUEUE_OWN_POLL_S
    return QUEUE_POLL_S


_WAITING: set[str] = set()  # jobs this process is waiting for (live_supervisor does not name this process)
_TOLD: dict[str, tuple[str, int]] = {}  # what was said last of each waiting job (said again only when it changes)


def wait_for_leases(prepared: Prepared, sup: Supervisor, store, rd: RunDir, busy: LeasesBusy, emit,
                    stamp: int | None = None) -> None:
    """The job is QUEUED: recorded with what it waits for (RUN_DIR/queue.json) and its place in this store's queue,
    told to the caller ("queued": {"job_id", "line", "position"}); once no job queued before it in this store wants
    an overlapping host/GPU (FIFO), returns as soon as a job of this store ends (store.wait_moved: within ~0.05 s;
    `stamp`: the store's wake_stamp() before the try that found the hosts leased, so an end during that try counts)
    or after queue_poll_s (QUEUE_POLL_S for a holder of another store, another user's), or at once when cancelled.
    The caller tries again."""
    job = prepared.plan.job_id
    line = str(busy)
    _WAITING.add(job)
    try:
        old = rd.read_json(RunDir.QUEUE)
        since = old.get("since") if isinstance(old, dict) and old.get("waiting_for") else None
        rd.write_json(RunDir.QUEUE, {"waiting_for": line, "since": since or time.time(), "t": time.time(),
                                     "busy": [{k: b.get(k) for k in ("host", "what", "holder")} for b in busy.busy]})
        store.update(job, JobState.QUEUED, detail=line[:500])
        told = _TOLD.get(job)
        poll = queue_poll_s(store, busy)
        while True:
            position = queue_positions().get(job, 1)
            if (line, position) != told:
                emit("queued", {"job_id": job, "line": line, "position": position})
                told = _TOLD[job] = (line, position)
            # a job of this store ended or started: look again at once; another store's (user's) holder: every
            # QUEUE_POLL_S
            store.wait_moved(poll, sup.cancel.wait, since=stamp)
            stamp = None
            if sup.cancel.is_set() or position == 1:
                return
    finally:
        _WAITING.discard(job)


def _replanned(prepared: Prepared, rd: RunDir, sup: Supervisor, emit, excluded: list[str]) -> LaunchPlan:
    """The run dir and the supervisor take the re-planned job (the hosts taken out gone, spares in); the caller is
    told ("replanned": the new node -> host map, for its output prefixes)."""
    from orchestrator.core.spec import cluster_to_dict
    write_files(dict(prepared.files, **{RunDir.CLUSTER: json.dumps(cluster_to_dict(prepared.cluster), indent=2,
                                                                   sort_keys=True) + "\n"}), rd.root)
    sup.plan = prepared.plan
    emit("replanned", {"job_id": prepared.plan.job_id, "excluded": excluded,
                       "hosts": {n.node_rank: n.host for n in prepared.plan.node_plans}})
    return prepared.plan


def _notifier(prepared: Prepared, rd: RunDir, sup: Supervisor, on_event):
    """The job's Notifier (orchestrator.notify), fed the heartbeats and watching restarts.jsonl; None without a
    notify: block. Failures to deliver are told through on_event("notify", {"job_id", "line"}) (else stderr)."""
    spec = getattr(prepared.recipe, "notify", None)
    if spec is None or not spec.on:
        return None
    from orchestrator.notify import Notifier, job_facts

    def say(line: str) -> None:
        if on_event:
            on_event("notify", {"job_id": prepared.plan.job_id, "line": line})
        else:
            print(f"orchestrate: job {prepared.plan.job_id}: {line}", file=sys.stderr, flush=True)

    notifier = Notifier(spec, job_facts(prepared, str(rd.root)), rd, say=say)
    beat = sup.on_beat

    def on_beat(rec: dict) -> None:
        notifier.beat(rec)
        if beat is not None:
            beat(rec)
    sup.on_beat = on_beat
    notifier.watch()
    return notifier


def restart_count(rd: RunDir) -> int:
    """Every restart, whoever decided it (RunDir.restarts)."""
    return rd.restarts()


def _run_once(prepared: Prepared, launcher, sup: Supervisor, store, rd: RunDir, attempt: int, on_event,
              adopt: JobHandle | None = None) -> JobResult:
    plan = prepared.plan
    if adopt is not None:  # submitted already (a SLURM sweep's array task): its records are this attempt's own
        if sup.cancel.is_set():
            launcher.cancel(adopt, rd)
            return JobResult(JobState.CANCELLED, 130, sup.cancel_reason)
        return _watch(launcher.adopt(adopt, rd), plan, sup, store, rd, attempt, on_event)
    for r in range(plan.nodes):  # an earlier attempt's records must not speak for this one
        for path in (rd.exit_file(r), rd.agent_file(r)):
            path.unlink(missing_ok=True)
    rd.path(RunDir.OUTCOME).unlink(missing_ok=True)
    submission = launcher.prepare(replace(plan, submitter=submitter()))  # (the lease files name who submitted it)
    if on_event and attempt == 0 and not rd.path(RunDir.QUEUE).exists():  # (said once, not on each look again)
        on_event("submitting", {"job_id": plan.job_id, "run_dir": str(rd.root)})
    try:
        running = launcher.submit(submission, rd, cancel=sup.cancel)
    except SubmitCancelled as e:  # Ctrl-C / cancel while the backend was still starting it: nothing runs
        return JobResult(JobState.CANCELLED, 130, sup.cancel_reason or str(e))
    except LeasesBusy:  # nothing started: the caller waits (QUEUED) or, with --no-wait, records it
        raise
    except Exception as e:
        if not getattr(e, "bad_hosts", None):  # (hosts a spare may replace: the caller decides, and records)
            store.update(plan.job_id, JobState.FAILED, detail=str(e)[:500], root_cause=str(e)[:500],
                         exit_code=getattr(e, "exit_code", None))
        raise
    return _watch(running, plan, sup, store, rd, attempt, on_event)


def _watch(running, plan: LaunchPlan, sup: Supervisor, store, rd: RunDir, attempt: int, on_event) -> JobResult:
    """The submitted attempt recorded (RUNNING, its handle) and supervised to its end."""
    store.update(plan.job_id, JobState.RUNNING, handle=running.handle.uri)
    try:
        rd.write_json(RunDir.HANDLE, {"uri": running.handle.uri, "data": running.handle.data})
    except (OSError, TypeError):
        pass
    if on_event:
        on_event("running", {"job_id": plan.job_id, "handle": running.handle.uri, "attempt": attempt})
    sup.attempt = attempt
    return sup.run(running)

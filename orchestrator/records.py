"""Queries and actions on recorded jobs, from any process: a job's record by id (or a unique prefix), its state
reconciled with its backend when nobody supervises it any more (the store never lies), the latest jobs, its logs,
cancel (its supervisor asked, else its backend), and a SLURM sweep's array job (its tasks, its cancel).

The backend of a recorded job is rebuilt from its run dir (cluster.json, handle.json).
"""

from __future__ import annotations

import os
import time
from typing import Any

from orchestrator.errors import ConfigError, OrchestratorError
from launchers import launcher_for
from orchestrator.running import _WAITING, outcome_record, restart_count
from orchestrator.node.rundir import RunDir
from orchestrator.types import JobHandle, JobResult, JobState, JobStatus, NodeExit, exit_text, is_terminal
from orchestrator.core.spec import ClusterSpec


def array_tasks(cluster: ClusterSpec, array: str) -> dict[int, str] | None:
    """{task: SLURM state} of a SLURM array's tasks still listed by the controller (None: it cannot tell)."""
    return launcher_for(cluster).array_tasks(array)


def cluster_of(run_dir: str) -> ClusterSpec:
    """The cluster a job ran on, from its run dir (cluster.json)."""
    from orchestrator.core.spec import cluster_from_dict
    data = RunDir(run_dir).read_json(RunDir.CLUSTER)
    if not isinstance(data, dict):
        raise OrchestratorError(f"run dir {run_dir} has no readable {RunDir.CLUSTER}")
    return cluster_from_dict(data)


def cancel_array(cluster: ClusterSpec, array: str) -> None:
    """scancel a sweep's whole array job: its running tasks and those not started yet."""
    launcher_for(cluster).cancel(JobHandle(f"slurm://{array}"))


# ------------------------------------------------------------------------------------------- any process

def _record(job: str):
    from orchestrator.store import JobStore
    rec = JobStore().get(job)
    if rec is None:
        raise ConfigError(f"job {job!r} not found (see `orchestrate ls`)")
    return rec


def _backend(rec) -> tuple[Any, JobHandle, RunDir]:
    """The launcher, handle and run dir of a recorded job, rebuilt from its run dir (cluster.json, handle.json)."""
    from orchestrator.core.spec import cluster_from_dict
    rd = RunDir(rec.run_dir)
    cluster_data, handle_data = rd.read_json(RunDir.CLUSTER), rd.read_json(RunDir.HANDLE)
    if not isinstance(cluster_data, dict):
        raise OrchestratorError(f"job {rec.id}: run dir {rd.root} has no readable {RunDir.CLUSTER}")
    h = handle_data if isinstance(handle_data, dict) else {"uri": rec.handle or "", "data": {}}
    handle = JobHandle(h.get("uri") or rec.handle or "", dict(h.get("data") or {}, run_dir=str(rd.root)))
    return launcher_for(cluster_from_dict(cluster_data)), handle, rd


def reconcile(rec):
    """The store never lies: a job recorded as not ended whose supervisor is gone is asked to its backend; when the
    backend says it ended (or nothing of it runs any more), the end is recorded. Returns (record, JobStatus|None)."""
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    if is_terminal(rec.state) or live_supervisor(rec.id) is not None:
        return rec, None
    if rec.state == JobState.QUEUED and rec.id not in _WAITING:  # its waiting submitter is gone: nothing ever started
        why = "the submitter waiting for leased hosts is gone; nothing was started"
        JobStore().update(rec.id, JobState.CANCELLED, detail=why, root_cause=why, exit_code=130, final=True)
        return JobStore().get(rec.id), None
    rd = RunDir(rec.run_dir)
    done = rd.outcome()  # the supervisor judged the end but could not record it in the store (a full disk)
    if done.get("state") in ("COMPLETED", "FAILED", "CANCELLED"):
        JobStore().update(rec.id, done["state"], detail=done.get("root_cause") or None,
                          root_cause=done.get("root_cause") or None, exit_code=done.get("exit_code"),
                          restarts=restart_count(rd), final=True)
        return JobStore().get(rec.id), None
    try:
        launcher, handle, rd = _backend(rec)
        st = launcher.status(handle, rd)
    except Exception as e:  # noqa: BLE001 - status must still show what the store knows
        if rec.state == JobState.PENDING and time.time() - rec.created < 120:
            return rec, None  # being submitted right now
        return rec, JobStatus(JobState(rec.state) if rec.state in JobState.__members__ else JobState.RUNNING, (),
                              f"backend unknown ({type(e).__name__}: {str(e)[:120]})")
    if st.state == JobState.RUNNING and not st.nodes and time.time() - rec.updated > 120:
        st = JobStatus(JobState.FAILED, (), "no node of the job ever started")
    if st.state.terminal:
        why = st.reason
        if st.state == JobState.FAILED and rec.backend != "slurm":
            why = "the supervising process is gone and no node of the job is running"
            bad = next((n for n in st.nodes if n.end == "failed"), None) or \
                next((n for n in st.nodes if n.returncode not in (0, None) or n.state == "lost"), None)
            if bad is not None:
                how = bad.end or bad.state
                why += (f"; node {bad.node_rank} ({bad.host}) {how}" + (f" (exit {exit_text(bad.returncode)})"
                        if bad.returncode is not None else "") + (f": {bad.reason}" if bad.reason else ""))
        code = 0 if st.state == JobState.COMPLETED else 1
        JobStore().update(rec.id, st.state, detail=why or None, root_cause=why or None,
                          restarts=restart_count(RunDir(rec.run_dir)), exit_code=code, final=True)
        rec = JobStore().get(rec.id)
        # what the hosts said of each node, kept: a later `status` (the record now ended) shows the same table
        nodes = [NodeExit(n.node_rank, n.host, n.returncode, end=n.end or ("lost" if n.state == "lost" else ""),
                          note=n.reason) for n in st.nodes]
        rd.write_outcome(outcome_record(JobResult(st.state, code, why or "", tuple(nodes)), "status"))
    return rec, st


def status(job: str):
    """(record, backend status or None): the store's record, reconciled with the backend when nobody supervises it."""
    return reconcile(_record(job))


RECONCILE_THREADS = 8


def jobs(limit: int | None = 20) -> list:
    """The latest `limit` records (None: all), each reconciled. The backends of the jobs nobody supervises are asked at
    once (up to RECONCILE_THREADS at a time): hosts that do not answer cost one connect timeout, not one each."""
    from concurrent.futures import ThreadPoolExecutor
    from orchestrator.store import JobStore
    recs = JobStore().list(limit)
    asked = [r for r in recs if not is_terminal(r.state)]
    if len(asked) <= 1:
        return [reconcile(r)[0] for r in recs]
    with ThreadPoolExecutor(min(RECONCILE_THREADS, len(asked)), thread_name_prefix="reconcile") as ex:
        fresh = dict(zip((r.id for r in asked), ex.map(lambda r: reconcile(r)[0], asked), strict=True))
    return [fresh.get(r.id, r) for r in recs]


def logs(job: str, node: int | None = None):
    rec = _record(job)
    launcher, handle, rd = _backend(rec)
    return launcher.logs(handle, rd, node)


def cancel(job: str, wait_s: float = 90.0, by: str = "cancelled by the user (orchestrate cancel)") -> str:
    """Cancel a job from any process: its supervisor is asked (a cancel request in the run dir + SIGTERM: it tears
    every node down and records CANCELLED); with no supervisor left, the backend is asked directly. Returns the
    final state; raises OrchestratorError when the job did not end within `wait_s`."""
    import signal as _signal
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    rec, _ = reconcile(_record(job))
    if is_terminal(rec.state):
        return rec.state
    rd = RunDir(rec.run_dir)
    sup = live_supervisor(rec.id)
    if sup is not None:
        rd.request_cancel(by)
        try:
            os.kill(sup, _signal.SIGTERM)
        except ProcessLookupError:
            sup = None
    if sup is not None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            state = JobStore().get(rec.id).state
            if is_terminal(state):
                return state
            time.sleep(0.2)
        raise OrchestratorError(f"job {rec.id}: its supervisor (pid {sup}) did not end the job within {wait_s:.0f} s; "
                                f"it is still {JobStore().get(rec.id).state}")
    launcher, handle, rd = _backend(rec)
    launcher.cancel(handle, rd)
    JobStore().update(rec.id, JobState.CANCELLED, detail=by, root_cause=by, exit_code=130, final=True)
    return JobStore().get(rec.id).state

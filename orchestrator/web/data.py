"""What the dashboard shows, as plain data: the ONE adapter between the web face and the rest of orchestrate.

Every fact comes through the readers the CLI uses: the store (`JobStore`), `views` (job_status, rank_rows,
notable_ranks/nodes, job_progress, job_times, group_sweeps), `plot` (job_curves, sweep_curves, series), `logtail`
(LogTail), `heartbeat.read_since`, `sweeps` (read_sweep, table_rows, point_of), `render` (summary, node_command_text:
the env masked as `render` masks it) and `running.queue_positions`. The one action is the public API's
`Job.cancel`. Nothing here knows a run-dir path or a store rule of its own.

Reading never writes: a job recorded as running whose supervisor is gone is shown as the store has it, marked
`stale` (`orchestrate status` reconciles it with its backend).
"""

from __future__ import annotations

import re
import time
from typing import Any

PER_PAGE = 100  # rows of the jobs page
RANKS_PER_PAGE = 256  # rows of a job's full rank table, per page
LOG_TAIL_BYTES = 64 << 10  # a log opened on the page: its last 64 KiB
LOG_READ_BYTES = 1 << 20  # at most this much of each log per look
LOG_MAX_NODES = 8  # a job of more nodes shows one node's log at a time (node 0 unless asked)
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class Snapshots:
    """Results of costly reads (a big job's status), kept: a result younger than `fresh_s` (at least twice what it
    cost) is answered as it is; an older one too, at once, while ONE background thread reads it again
    (stale-while-revalidate); one older than `keep_s`, or none, is read now. A page of a 1,024 x 8-rank job then costs
    its reader at most every 2 x what reading it costs however many people watch it, and no answer waits for it."""

    def __init__(self, fresh_s: float = 1.0, keep_s: float = 30.0):
        import threading
        self.fresh_s, self.keep_s = fresh_s, keep_s
        self.lock = threading.Lock()
        self.cache: dict[Any, tuple[float, float, Any]] = {}  # key -> (when read, what it cost, result)
        self.busy: set[Any] = set()

    def _read(self, key: Any, fn) -> Any:
        t = time.monotonic()
        try:
            value = fn()
        except BaseException:
            with self.lock:
                self.cache.pop(key, None)
            raise
        finally:
            with self.lock:
                self.busy.discard(key)
        with self.lock:
            self.cache[key] = (time.monotonic(), time.monotonic() - t, value)
            for k in [k for k, v in self.cache.items() if time.monotonic() - v[0] > self.keep_s]:
                del self.cache[k]
        return value

    def get(self, key: Any, fn) -> Any:
        import threading
        with self.lock:
            hit = self.cache.get(key)
            age = time.monotonic() - hit[0] if hit else None
            if hit and age is not None and age < max(self.fresh_s, 2 * hit[1]):
                return hit[2]
            if hit and age is not None and age < self.keep_s:
                if key not in self.busy:
                    self.busy.add(key)
                    threading.Thread(target=self._refresh, args=(key, fn), daemon=True,
                                     name="dashboard-refresh").start()
                return hit[2]
        return self._read(key, fn)

    def _refresh(self, key: Any, fn) -> None:
        try:
            self._read(key, fn)
        except Exception:  # noqa: BLE001 - the next request reads it again and shows the error
            pass


SNAPSHOTS = Snapshots(fresh_s=0.25)  # (a small job's page: read again on every look but 4 a second; a big one's
# every 2 x what it costs)


class NotFound(Exception):
    """No such job / sweep (the page answers 404)."""


def _store():
    from orchestrator.store import JobStore
    return JobStore()


def record(job: str):
    """The store's record of `job` (an exact id or a unique prefix), NotFound otherwise."""
    if not JOB_ID.match(job or ""):
        raise NotFound(job)
    rec = _store().get(job)
    if rec is None:
        raise NotFound(job)
    return rec


def _stale(rec) -> bool:
    from orchestrator.detach import live_supervisor
    from orchestrator.types import is_terminal
    return not is_terminal(rec.state) and rec.backend != "slurm" and live_supervisor(rec.id) is None


# ------------------------------------------------------------------------------------------------ jobs

def jobs(state: str = "", backend: str = "", cluster: str = "", text: str = "", page: int = 1) -> dict[str, Any]:
    """The jobs page: every record newest first, filtered, one page of PER_PAGE rows (each with its progress, times,
    queue place, sweep point), the facets to filter by, and a count per state (a snapshot: `Snapshots`)."""
    return SNAPSHOTS.get(("jobs", state, backend, cluster, text.strip().lower(), page),
                         lambda: read_jobs(state, backend, cluster, text, page))


def read_jobs(state: str = "", backend: str = "", cluster: str = "", text: str = "", page: int = 1,
              now: float | None = None) -> dict[str, Any]:
    """`jobs`, read now."""
    from orchestrator.cli.views import group_sweeps, job_progress, job_times
    from orchestrator.sweeps import point_of
    now = time.time() if now is None else now
    store = _store()
    recs = store.list(None)
    counts: dict[str, int] = {}
    for r in recs:
        counts[r.state] = counts.get(r.state, 0) + 1
    facets = {"state": sorted(counts), "backend": sorted({r.backend for r in recs}),
              "cluster": sorted({r.cluster for r in recs})}
    needle = text.strip().lower()
    picked = [r for r in recs if (not state or r.state == state) and (not backend or r.backend == backend)
              and (not cluster or r.cluster == cluster)
              and (not needle or any(needle in (v or "").lower() for v in (r.id, r.recipe, r.cluster, r.root_cause)))]
    pages = max(1, -(-len(picked) // PER_PAGE))
    page = min(max(1, page), pages)
    shown = picked[(page - 1) * PER_PAGE:page * PER_PAGE]
    queue = queue_positions(recs) if any(r.state == "QUEUED" for r in shown) else {}
    rows = []
    events = store.events_of([r.id for r in shown])
    for r in shown:
        row = {**r.to_dict(), **job_progress(r.run_dir), **job_times(r.to_dict(), events[r.id], now),
               "stale": _stale(r), "age_s": now - r.created, **(point_of(r.id, r.run_dir) or {})}
        if r.id in queue:
            row["queue_position"] = queue[r.id]
        rows.append(row)
    return {"rows": group_sweeps(rows), "total": len(recs), "matched": len(picked), "page": page, "pages": pages,
            "facets": facets, "counts": counts}


def queue_positions(recs=None) -> dict[str, int]:
    from orchestrator.running import queue_positions as positions
    return positions(recs)


# ------------------------------------------------------------------------------------------------ one job

def job(job_id: str, ranks_page: int | None = None, now: float | None = None) -> dict[str, Any]:
    """A job's page: `views.job_status` (what `status --json` prints), its rank rows (the notable ones of a big job
    and a summary, or one page of all with `ranks_page`), node rows, plan summary, masked per-node env/command, the
    hang diagnosis, the store's events and times."""
    from orchestrator.cli.views import job_times, notable_nodes, notable_ranks
    from orchestrator.node.rundir import RunDir
    rec = record(job_id)
    now = time.time() if now is None else now
    queue = queue_positions() if rec.state == "QUEUED" else {}
    st, rows = SNAPSHOTS.get(("status", rec.id), lambda: _status_rows(rec, queue.get(rec.id)))
    st = dict(st, **{k: getattr(rec, k) for k in ("state", "exit_code", "root_cause", "restarts", "updated", "handle")})
    if st["state"] != "QUEUED":  # (the record is read on every look; the ranks' snapshot at most a second or so old)
        st["queue"] = None
    total = len(rows)
    if ranks_page is not None:
        pages = max(1, -(-total // RANKS_PER_PAGE))
        ranks_page = min(max(1, ranks_page), pages)
        shown, summary = rows[(ranks_page - 1) * RANKS_PER_PAGE:ranks_page * RANKS_PER_PAGE], \
            f"{total} ranks; page {ranks_page} of {pages}"
    else:
        pages = max(1, -(-total // RANKS_PER_PAGE))
        shown, summary = notable_ranks(st, rows)
    nodes, node_summary = notable_nodes(st)
    store = _store()
    events = store.events(rec.id)
    rd = RunDir(rec.run_dir)
    diagnosis = rd.read_json(RunDir.DIAGNOSIS)  # (the hang analysis' record, where one was made)
    st["nodes"] = nodes  # (the shown ones: a big job's are summarised)
    st.pop("ranks", None)  # (every rank's curve: only the rows shown travel)
    return {"status": st, "ranks": shown, "ranks_summary": summary, "ranks_total": total, "ranks_pages": pages,
            "ranks_page": ranks_page, "node_summary": node_summary,
            "plan": SNAPSHOTS.get(("plan", rec.id), lambda: plan_summary(rd)),
            "diagnosis": diagnosis if isinstance(diagnosis, dict) else None, "events": events[-50:],
            "times": job_times(rec.to_dict(), events, now), "stale": _stale(rec), "now": now}


def _status_rows(rec, position: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`views.job_status` (what `status --json` prints) and its rank rows, each row with its forward time and
    straggler verdict."""
    from orchestrator.cli.views import job_status, rank_rows
    st = job_status(dict(rec.to_dict(), queue_position=position))
    rows = rank_rows(st)
    extra = {r["rank"]: r for r in st["ranks"]}
    for row in rows:
        e = extra.get(row["rank"]) or {}
        row["compute_s"], row["straggler"] = e.get("compute_s"), e.get("straggler")
    return st, rows


def plan_summary(rd) -> dict[str, Any] | None:
    """The plan as `render` / `submit` print it (core.render.summary) and node 0's environment and command exactly as
    `render` writes them (secrets masked: names only), plus the plan's facts the page shows in a table."""
    from orchestrator.core.render import node_command_text, summary
    try:
        plan = rd.read_plan()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    hosts = [n.host or "(scheduler)" for n in plan.node_plans]
    return {"text": summary(plan), "command": node_command_text(plan, 0) if plan.node_plans else "",
            "hosts": hosts[:16], "hosts_more": max(0, len(hosts) - 16), "profile": plan.profile,
            "world_size": plan.world_size, "nodes": plan.nodes, "procs_per_node": plan.procs_per_node,
            "effective_batch": plan.effective_batch, "tokens_per_step": plan.tokens_per_step,
            "container": plan.container.image if plan.container is not None else None,
            "cluster_kind": plan.cluster_kind}


def series(job_id: str, offsets: dict[int, int] | None = None) -> dict[str, Any]:
    """Loss and tokens/s per drawn rank (every rank of a job of at most 8, else rank 0, as `plot` draws): the whole
    curves (`plot.job_curves`, bounded by heartbeat.read_sampled) when `offsets` is None, else only what each rank's
    file gained after its offset (heartbeat.read_since; a point may come twice: the page keeps the first). Each rank's
    `offset` is where the next look starts."""
    from orchestrator.cli.plot import drawn_ranks, job_curves, series as curves_of
    from orchestrator.node.heartbeat import read_since
    from orchestrator.node.rundir import RunDir
    rec = record(job_id)
    rd = RunDir(rec.run_dir)
    plan = rd.read_json(RunDir.PLAN)
    world = plan.get("world_size") if isinstance(plan, dict) and isinstance(plan.get("world_size"), int) else None
    ranks = drawn_ranks(rd, world)
    out: dict[int, dict[str, Any]] = {}
    if offsets is None:
        sizes = {}
        for r in ranks:
            try:
                sizes[r] = rd.path(RunDir.heartbeat_rel(r)).stat().st_size
            except OSError:
                sizes[r] = 0
        loss, speed, drew = job_curves(rec.run_dir, ranks)
        for r in ranks:
            out[r] = {"loss": loss.get(r) or [], "speed": speed.get(r) or [], "offset": sizes[r]}
        return {"ranks": out, "drew": drew, "state": rec.state}
    for r in ranks:
        try:
            recs, end = read_since(rd.path(RunDir.heartbeat_rel(r)), offsets.get(r, 0))
        except OSError:
            recs, end = [], offsets.get(r, 0)
        loss, speed = curves_of(recs)
        out[r] = {"loss": loss.get(r) or [], "speed": speed.get(r) or [], "offset": end}
    return {"ranks": out, "state": rec.state}


def log(job_id: str, rank: int | None = None, node: int | None = None, text: str = "",
        offsets: dict[int, int] | None = None) -> dict[str, Any]:
    """The job's log lines as `orchestrate logs` prints them (LogTail: prefixed, heartbeat lines out, `--rank`,
    `--node`), filtered by a plain text; the last LOG_TAIL_BYTES of each log first, then (`offsets`) what came since.
    A job of more than LOG_MAX_NODES nodes shows one node's log (node 0 unless a node or rank is asked)."""
    from orchestrator.cli.logtail import LogTail
    rec = record(job_id)
    if rank is None and node is None and rec.nodes > LOG_MAX_NODES:
        node = 0
    tail = LogTail(rec.run_dir, node=node, rank=rank, grep=re.escape(text) if text else None,
                   tail_bytes=LOG_TAIL_BYTES, offsets=offsets)
    lines = list(tail.lines(max_bytes=LOG_READ_BYTES))
    return {"lines": lines[-2000:], "offsets": tail.positions(), "node": tail.node, "state": rec.state}


def cancel(job_id: str) -> str:
    """Cancel through the public API (`Job.cancel`: the supervisor tears every node down and records CANCELLED);
    returns the final state."""
    from orchestrator.client import Job
    return Job(record(job_id).id).cancel()


# ------------------------------------------------------------------------------------------------ sweeps, queue

def sweep(sweep_id: str) -> dict[str, Any]:
    """A sweep's page: its points as `orchestrate sweep` lists them (sorted by final loss), the best point."""
    from orchestrator import sweeps
    if not JOB_ID.match(sweep_id or "") or not sweep_id.startswith("sweep-"):
        raise NotFound(sweep_id)
    doc = sweeps.read_sweep(sweep_id)
    if doc is None:
        raise NotFound(sweep_id)
    rows = sweeps.table_rows(doc)
    best = next((r for r in rows if r["final_loss"] is not None), None)
    return {"id": doc["id"], "created": doc.get("created"), "max_parallel": doc.get("max_parallel"),
            "job_file": doc.get("job_file"), "cluster": doc.get("cluster"), "overrides": doc.get("overrides") or [],
            "points": rows, "best": best}


def sweep_curves(sweep_id: str) -> dict[str, Any]:
    """Rank 0's loss of every point (plot.sweep_curves: what `plot SWEEP_ID` draws)."""
    from orchestrator import sweeps
    from orchestrator.cli.plot import sweep_curves as curves
    doc = sweeps.read_sweep(sweep_id) if JOB_ID.match(sweep_id or "") else None
    if doc is None:
        raise NotFound(sweep_id)
    store = _store()
    points = [(f"p{pt['index']} {' '.join(pt['overrides'])}", rec.run_dir) for pt in doc.get("points") or []
              if (rec := store.get(pt["job_id"])) is not None]
    got, sampled = curves(points)
    return {"curves": [{"label": label, "points": pts} for label, pts in got], "downsampled": sampled}


def queue() -> dict[str, Any]:
    """The queue page: this store's QUEUED jobs in queue order, what each waits for and who holds it (the lease's
    holder: job, user@host, since), and the running jobs of this store (a snapshot: `Snapshots`)."""
    return SNAPSHOTS.get(("queue",), read_queue)


def read_queue(now: float | None = None) -> dict[str, Any]:
    """`queue`, read now."""
    from orchestrator.cli.views import job_status
    now = time.time() if now is None else now
    recs = _store().list(None)
    positions = queue_positions(recs)
    waiting = []
    for r in recs:
        if r.state != "QUEUED":
            continue
        q = job_status(dict(r.to_dict(), queue_position=positions.get(r.id)), now=now).get("queue") or {}
        waiting.append({"id": r.id, "position": positions.get(r.id), "waiting_for": q.get("waiting_for"),
                        "holders": q.get("holders") or [], "since": q.get("since"), "created": r.created,
                        "nodes": r.nodes, "cluster": r.cluster, "backend": r.backend, "stale": _stale(r)})
    waiting.sort(key=lambda w: (w["position"] is None, w["position"] or 0, w["created"]))
    running = [{"id": r.id, "nodes": r.nodes, "cluster": r.cluster, "backend": r.backend, "since": r.updated,
                "state": r.state} for r in recs if r.state in ("RUNNING", "PENDING")]
    return {"queued": waiting, "running": running, "now": now}

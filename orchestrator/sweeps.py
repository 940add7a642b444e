"""Sweeps, the side effects: every point validated first, then run as ordinary jobs, at most --max-parallel at once.

`orchestrate submit JOB --sweep KEY=V1,V2 [--sweep ...] [--max-parallel P] [--stop-if-worse X]` expands the grid
(orchestrator/core/sweep.py), plans every point with the job's own flags and overrides plus the point's (any bad
point: exit 2 naming the point and the key, nothing submitted), records the sweep in ORCHESTRATE_HOME/sweeps/<sweep
id>.json, then runs each point as `orchestrate submit ... --job-id <sweep id>-p<i>` in a session of its own: a point
is a job like any other (run dir, store record, supervisor, restarts, its own output dir `<output dir>/<sweep
id>-p<i>`), and `status`, `logs` and `cancel` work on it. The runner streams each point's output prefixed `[p<i>]`,
starts the next point when one ends, and on Ctrl-C / SIGTERM / SIGHUP (or `orchestrate cancel SWEEP_ID`) starts no
more and cancels the running ones. `orchestrate sweep SWEEP_ID` prints the points sorted by their final loss (rank
0's last logged loss). With --stop-if-worse X a running point whose loss is NaN, or above X times the best loss
another point had at the same step, is cancelled and recorded as stopped early (the sweep still succeeds). Local and
SSH clusters (on SSH, points wait for each other's hosts through the hosts' leases where those exist).

On SLURM the sweep is ONE array job (`sbatch --array=0-N%P`, one sbatch: running.submit_array, the SLURM launcher's
submitit path): every point's run dir and record are written first (PENDING), then array task i runs point p<i> in an
allocation of its own, at most P at once (SLURM's own throttle), each with its own requeue budget. The runner then
watches the array (squeue) and, as each task leaves PENDING, starts that point's supervisor: `orchestrate submit ...
--job-id <sweep id>-p<i> --adopt slurm://<array>_<i>`, the same submit as above except that it watches the task
instead of submitting one. Cancelling the sweep scancels the whole array (tasks not started included). A hang-up
(SIGHUP) of an attached SLURM sweep cancels nothing: the runner's output moves to log_path and `attach SWEEP_ID`
follows it, as a single SLURM job runs on in its allocation.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from orchestrator.core.sweep import Point, check_parallel, expand, point_job_id
from orchestrator.detach import live_sweep_runner
from orchestrator.errors import ConfigError, Problem
from orchestrator.node.heartbeat import appended, read_tail
from orchestrator.node.rundir import RunDir
from orchestrator.store import sweeps_dir

SWEEPS = "sweeps"
SWEEP_FILE = "sweep.json"  # a rendered sweep's points (render)
WAITING = ("PENDING", "REQUEUED", "CONFIGURING")  # an array task's SLURM states before it runs (squeue)


def new_sweep_id() -> str:
    return f"sweep-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def read_sweep(sweep_id: str) -> dict[str, Any] | None:
    try:
        data = json.loads((sweeps_dir() / f"{sweep_id}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_sweep(doc: dict[str, Any]) -> None:
    from orchestrator.store import private_dir
    d = private_dir(sweeps_dir())
    tmp = d / f".{doc['id']}.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, d / f"{doc['id']}.json")


def _output_override(prepared, point_dir: str) -> str | None:
    """The override that gives a point its own output dir: the built-in recipes' trainer.output_dir, own code's
    run.args.output_dir (mapping-form args); None where the job's output dir cannot be set apart."""
    from orchestrator.core.spec import RunJobSpec
    recipe = prepared.recipe
    if not isinstance(recipe, RunJobSpec):
        return f"trainer.output_dir={Path(recipe.trainer['output_dir']) / point_dir}"
    if isinstance(recipe.run.args, dict):
        return f"run.args.output_dir={Path(recipe.output_dir) / point_dir}"
    return None


def plan_points(args, options: list[str], run_dirs: str | None = None
                ) -> tuple[str, list[tuple[Point, list[str], str, Any]], Any]:
    """(sweep id, [(point, its overrides, its run dir, its Prepared)], the first point's Prepared): every point
    planned, every problem named (on SLURM also what keeps the points from being one array job). `run_dirs`: point
    p<i>'s run dir is RUN_DIRS/p<i> (render: its output directory), else the one a job gets."""
    from orchestrator import api
    points = expand(options)
    sweep_id = getattr(args, "sweep_id", None) or new_sweep_id()  # (a detached runner: the id its submit printed)
    probe = not getattr(args, "dry_run", False) or getattr(args, "probe", False)  # (a dry run asks no host)
    base = api.prepare(args.recipe, args.cluster, nodes=args.nodes, procs_per_node=args.procs_per_node,
                       profile=args.profile, overrides=list(args.overrides), job_id=sweep_id, probe=probe,
                       judge_checkpoints=False)  # (only its output dir is used: each point's own is judged)
    planned, problems, first = [], [], None
    for point in points:
        jid = point_job_id(sweep_id, point)
        out = _output_override(base, jid)
        if out is None:
            raise ConfigError(Problem("--sweep", "each point needs its own output dir: give own code's args as a "
                                                 "mapping (run.args: {output_dir: ...}) so the sweep can set it"),
                              source=args.recipe)
        overrides = list(args.overrides) + list(point.overrides) + [out]
        try:
            prepared = api.prepare(args.recipe, args.cluster, nodes=args.nodes, procs_per_node=args.procs_per_node,
                                   profile=args.profile, overrides=overrides, job_id=jid, probe=probe,
                                   run_dir=str(Path(run_dirs) / f"p{point.index}") if run_dirs else None)
        except ConfigError as e:
            problems += [Problem(f"point p{point.index} ({point.label()}): {p.where}".rstrip(": "), p.message)
                         for p in e.problems]
            continue
        first = first or prepared
        planned.append((point, overrides, prepared.plan.run_dir, prepared))
    if problems:
        raise ConfigError(problems, source=args.recipe)
    if base.cluster.kind == "slurm":
        from launchers.slurm.sbatch import array_problems
        problems = array_problems([(p.plan, p.cluster.slurm) for *_, p in planned])
        if problems:
            raise ConfigError(problems, source=args.recipe)
    return sweep_id, planned, first


def sweep_folder(first, sweep_id: str) -> str:
    """A SLURM sweep's own dir on the shared filesystem: SLURM_WORKDIR/sweeps/<sweep id> (the array's job.sbatch,
    SLURM's output per task, submitit's files)."""
    return str(Path(first.cluster.slurm.workdir).expanduser() / SWEEPS / sweep_id)


def array_script(sweep_id: str, planned, first, parallel: int, folder: str | None = None) -> str:
    """The sweep's ONE array job script (launchers.slurm.sbatch.render_array_sbatch): SWEEP_DIR/job.sbatch (`folder`:
    another dir, render's output directory)."""
    from launchers.slurm.sbatch import render_array_sbatch
    return render_array_sbatch([(p.plan, p.cluster.slurm) for *_, p in planned], parallel, sweep_id,
                               folder or sweep_folder(first, sweep_id))


def render(args, options: list[str], out: str) -> tuple[str, list[tuple[Point, list[str], str, Any]], dict[str, str]]:
    """`render --sweep`: (sweep id, the planned points, every file) of the sweep rendered into directory `out`: each
    point's files under p<i>/ (its run dir, as planned), sweep.json (which point is which) and on SLURM the array
    script job.sbatch naming those run dirs, so `sbatch OUT/job.sbatch` runs the sweep (without a runner: no store
    records, no --stop-if-worse)."""
    sweep_id, planned, first = plan_points(args, options, run_dirs=out)
    parallel = check_parallel(args.max_parallel, len(planned))
    files = {f"p{point.index}/{rel}": text for point, *_, prepared in planned for rel, text in prepared.files.items()}
    doc = {"id": sweep_id, "job_file": str(args.recipe), "max_parallel": parallel, "options": list(options),
           "points": [{"index": p.index, "overrides": list(p.overrides), "job_id": point_job_id(sweep_id, p),
                       "run_dir": rd} for p, _, rd, _ in planned]}
    files[SWEEP_FILE] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if first.cluster.kind == "slurm":
        files[RunDir.SBATCH] = array_script(sweep_id, planned, first, parallel, folder=out)
    return sweep_id, planned, files


def _child_argv(args, overrides: list[str], job_id: str, adopt: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "orchestrator.cli", "submit", str(args.recipe), *overrides, "--job-id", job_id]
    argv += ["--adopt", adopt] if adopt else []
    for flag, value in (("--nodes", args.nodes), ("--procs-per-node", args.procs_per_node),
                        ("--profile", args.profile), ("--cluster", args.cluster)):
        if value is not None:
            argv += [flag, str(value)]
    if args.quiet:
        argv.append("--quiet")
    if getattr(args, "no_wait", False):  # a point whose hosts are leased ends at once (exit 75) instead of QUEUED
        argv.append("--no-wait")
    return argv


def run(args, options: list[str], say: Callable[[str], None] = print) -> int:
    """Plan every point, then run them at most --max-parallel at once. Exit 0 when every point COMPLETED, 130 when
    cancelled, else 1."""
    from orchestrator import records
    from orchestrator import running
    from orchestrator.store import JobStore
    from orchestrator.types import is_terminal
    say = _quiet_when_gone(say)
    sweep_id, planned, first = plan_points(args, options)
    parallel = check_parallel(args.max_parallel, len(planned))
    slurm = first.cluster.kind == "slurm"
    JobStore()  # the store exists (schema, WAL mode) before points start at once: a new store made by two submits at
    # the same moment could answer one of them 'database is locked' before its job existed
    doc = {"id": sweep_id, "created": time.time(), "job_file": str(args.recipe), "cluster": args.cluster,
           "overrides": list(args.overrides), "options": list(options), "max_parallel": parallel,
           "runner_pid": os.getpid(), "points": [{"index": p.index, "overrides": list(p.overrides),
                                                  "job_id": point_job_id(sweep_id, p), "run_dir": rd}
                                                 for p, _, rd, _ in planned]}
    if slurm:
        doc.update(backend="slurm", slurm_array=None, sbatch=str(Path(sweep_folder(first, sweep_id), "job.sbatch")))
    _write_sweep(doc)
    say(f"sweep {sweep_id}: {len(planned)} point(s), at most {parallel} at once "
        f"(orchestrate sweep {sweep_id}; orchestrate cancel {sweep_id})")
    cancel = threading.Event()
    procs: dict[int, subprocess.Popen] = {}
    codes: dict[int, int] = {}
    lock = threading.Lock()

    hung_up = threading.Event()

    def stop(sig=None, _frame=None) -> None:
        if sig == signal.SIGHUP and slurm:  # the terminal went away: the array runs on, as a SLURM job does
            if not hung_up.is_set():
                _output_to(log_path(sweep_id))  # (from now on: `attach SWEEP_ID` follows it there)
            hung_up.set()
            return
        cancel.set()
        if doc.get("slurm_array"):
            threading.Thread(target=_scancel_array, args=(first.cluster, doc["slurm_array"]), daemon=True).start()
        why = cancel_reason(sweep_id, {signal.SIGINT: "interrupted (Ctrl-C)"}.get(
            sig, f"its runner got {signal.Signals(sig).name}" if sig else "its runner stopped"))
        with lock:
            for i, p in procs.items():
                if p.poll() is None:
                    rd = RunDir(doc["points"][i]["run_dir"])  # every point the same cause, naming the sweep
                    if rd.cancel_request() is None:  # (`orchestrate cancel SWEEP` wrote its own first)
                        rd.request_cancel(why)
                    try:
                        os.kill(p.pid, signal.SIGTERM)  # (the point's submit cancels its job and exits)
                    except ProcessLookupError:
                        pass

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    tails: dict[int, list[str]] = {}

    def pump(index: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        tail = tails.setdefault(index, [])
        for line in p.stdout:
            tail[:] = (tail + [line.rstrip()])[-3:]
            try:
                say(f"[p{index}] {line.rstrip()}")
            except OSError:
                pass

    pending = list(planned)
    readers: list[threading.Thread] = []
    curves = Curves()
    next_judge = next_look = 0.0
    handles: dict[int, str] = {}
    tasks: dict[int, str] | None = None
    try:
        if slurm:  # ONE array job: every point's record and run dir, then one sbatch
            array, hs = running.submit_array([p for *_, p in planned], parallel=parallel, name=sweep_id,
                                         folder=sweep_folder(first, sweep_id),
                                         script=array_script(sweep_id, planned, first, parallel), cancel=cancel)
            handles = {p.index: h.uri for (p, *_), h in zip(planned, hs, strict=True)}
            doc["slurm_array"] = array
            _write_sweep(doc)
            say(f"sweep {sweep_id}: SLURM array job {array} (--array=0-{len(planned) - 1}%{parallel}: one sbatch, "
                f"task i = point p<i>; {doc['sbatch']})")
            if cancel.is_set():  # (asked while sbatch answered)
                _scancel_array(first.cluster, array)
        while (pending or procs) and not (cancel.is_set() and not procs):
            if hung_up.is_set() and doc.get("hung_up") is None:
                doc["hung_up"] = time.time()
                _write_sweep(doc)
                say(f"sweep {sweep_id}: the submitting terminal hung up (SIGHUP): the array keeps running and this "
                    f"runner follows it; its output goes on here (orchestrate attach {sweep_id})")
            with lock:
                for i, p in list(procs.items()):
                    if p.poll() is not None:
                        codes[i] = p.returncode
                        del procs[i]
                if args.stop_if_worse and time.monotonic() >= next_judge:
                    next_judge = time.monotonic() + 1.0
                    for i, why in curves.judge(doc, set(procs), float(args.stop_if_worse)).items():
                        _stop_early(doc, i, why, procs[i])
                        say(f"sweep {sweep_id}: p{i} stopped early: {why}")
                if slurm and time.monotonic() >= next_look and not cancel.is_set():
                    next_look = time.monotonic() + 1.0
                    tasks = records.array_tasks(first.cluster, str(doc["slurm_array"]))
                for item in list(pending):
                    if cancel.is_set() or (not slurm and len(procs) >= parallel):
                        break
                    if slurm and tasks is not None and tasks.get(item[0].index) in WAITING:
                        continue  # (SLURM: once its task started, or ended already, its supervisor watches it from
                        # its start; squeue not answering: it is started at once and watches the task wait)
                    pending.remove(item)
                    point, overrides, _, _ = item
                    jid = point_job_id(sweep_id, point)
                    rec = JobStore().get(jid) if slurm else None
                    if rec is not None and is_terminal(rec.state):  # (cancelled on its own before its task started)
                        continue
                    say(f"sweep {sweep_id}: starting p{point.index} ({point.label()}) as job {jid}"
                        + (f" (array task {handles[point.index].rpartition('/')[2]})" if slurm else ""))
                    p = subprocess.Popen(_child_argv(args, overrides, jid, handles.get(point.index)),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         errors="replace", start_new_session=True)
                    procs[point.index] = p
                    t = threading.Thread(target=pump, args=(point.index, p), daemon=True)
                    t.start()
                    readers.append(t)
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in readers:
            t.join(5)
    if slurm:  # points whose supervisor never started (the sweep was cancelled first): their end, from SLURM
        for pt in doc["points"]:
            if pt["index"] not in codes:
                _settle(pt["job_id"], cancel.is_set(), doc["id"])
    for pt in doc["points"]:  # a point whose submit ended before its job existed: say why, in the table too
        i = pt["index"]
        if i in codes and JobStore().get(pt["job_id"]) is None:
            pt["not_started"] = f"its submit exited {codes[i]}: " + " / ".join(tails.get(i, []))[-300:]
            say(f"sweep {sweep_id}: p{i} did not start: {pt['not_started']}")
    _write_sweep(doc)
    states = table_rows(doc)
    say(sweep_text(doc, states))
    if cancel.is_set():
        return 130
    return 0 if all(r["state"] == "COMPLETED" or r.get("stopped_early") for r in states) else 1


def _quiet_when_gone(say: Callable[[str], None]) -> Callable[[str], None]:
    """`say`, but a write to a terminal that hung up (EIO) or a closed pipe loses the line instead of the runner."""
    def safe(line: str) -> None:
        try:
            say(line)
        except OSError:
            pass
    return safe


def _output_to(log: Path) -> None:
    """This process's stdout and stderr from now on: appended to `log` (a SLURM sweep whose terminal hung up).
    Called from a signal handler: file descriptors only, no buffered I/O."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _scancel_array(cluster, array: str) -> None:
    from orchestrator import records
    try:
        records.cancel_array(cluster, array)
    except Exception:  # noqa: BLE001 - the array may have ended already; each point's supervisor cancels its own
        pass


def _settle(job_id: str, cancelled: bool, sweep_id: str) -> None:
    """A SLURM point nobody supervised: its end as SLURM tells it (records.reconcile), else CANCELLED with the sweep."""
    from orchestrator import records
    from orchestrator.store import JobStore
    from orchestrator.types import is_terminal
    rec = JobStore().get(job_id)
    if rec is None or is_terminal(rec.state):
        return
    for _ in range(20 if cancelled else 1):  # (scancel reaches the accounting a moment later)
        try:
            rec, _st = records.reconcile(rec)
        except Exception:  # noqa: BLE001 - the record stays as it is; `status` asks again
            return
        if is_terminal(rec.state) or not cancelled:
            return
        time.sleep(0.25)
    why = f"sweep {sweep_id} was cancelled before this point started"
    JobStore().update(job_id, "CANCELLED", detail=why, root_cause=why, exit_code=130, final=True)


class Curves:
    """Rank 0's loss per step of every point, read incrementally from its heartbeats (its run dir's, as planned)."""

    def __init__(self) -> None:
        self.loss: dict[int, dict[int, float]] = {}  # point -> step -> loss (NaN kept)
        self.offsets: dict[int, int] = {}

    def read(self, index: int, run_dir: str) -> dict[int, float]:
        curve = self.loss.setdefault(index, {})
        try:
            for end, rec in appended(_rank0(run_dir), self.offsets.get(index, 0)):
                self.offsets[index] = end
                if rec is not None and isinstance(rec.get("loss"), (int, float)) and isinstance(rec.get("step"), int):
                    curve[rec["step"]] = float(rec["loss"])
        except OSError:
            pass
        return curve

    def judge(self, doc: dict[str, Any], running: set[int], factor: float) -> dict[int, str]:
        """Running points to stop: a NaN / infinite loss, or a loss above `factor` x the best loss any other point
        had at the same step (the latest step it shares with another point)."""
        for pt in doc["points"]:
            self.read(pt["index"], pt["run_dir"])
        out = {}
        for i in sorted(running):
            curve = self.loss.get(i) or {}
            if not curve:
                continue
            bad = [st for st, v in curve.items() if not math.isfinite(v)]
            if bad:
                out[i] = f"loss {curve[min(bad)]} at step {min(bad)}"
                continue
            # the latest step another point logged too (a point ahead of the others is judged where they are)
            shared = set(curve) & {st for j, c in self.loss.items() if j != i for st in c}
            if not shared:
                continue
            step = max(shared)
            loss = curve[step]
            others = [(c[step], j) for j, c in self.loss.items() if j != i and step in c and math.isfinite(c[step])]
            if others:
                best, j = min(others)
                if best > 0 and loss > factor * best:
                    out[i] = (f"loss {loss:.4g} at step {step} is more than {factor:g} x the best point's "
                              f"{best:.4g} (p{j}) at that step")
        return out


def _stop_early(doc: dict[str, Any], index: int, why: str, proc: subprocess.Popen) -> None:
    """Cancel point `index` (its submit is our child) with the reason recorded in its run dir and the sweep."""
    from orchestrator.node.rundir import RunDir
    from orchestrator.store import JobStore
    pt = next(p for p in doc["points"] if p["index"] == index)
    rec = JobStore().get(pt["job_id"])
    if rec is not None:
        RunDir(rec.run_dir).request_cancel(f"stopped early by sweep {doc['id']}: {why}")
    pt["stopped_early"] = why
    _write_sweep(doc)
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


class LossSummaries:
    """Each point's (final loss, best loss, last step) of rank 0's heartbeats, kept in ORCHESTRATE_HOME/sweeps/<sweep
    id>.losses.json with the byte offset they were read up to (a cache: any reader may rewrite it, losing it only
    costs a re-read). A heartbeat file only grows, so `orchestrate sweep` reads each point's rank 0 file once and then
    only what was appended since: a point that ended is not read again, a running one costs its new steps, never the
    whole run (nor any other rank's file)."""

    def __init__(self, sweep_id: str):
        self.path = sweeps_dir() / f"{sweep_id}.losses.json"
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        self.points: dict[str, dict[str, Any]] = data if isinstance(data, dict) else {}
        self.changed = False

    def of(self, job_id: str, run_dir: str) -> tuple[float | None, float | None, int | None]:
        path = _rank0(run_dir)
        try:
            st = path.stat()
        except OSError:
            return None, None, None
        old = self.points.get(job_id)
        if not (isinstance(old, dict) and old.get("run_dir") == run_dir and old.get("ino") == st.st_ino
                and isinstance(old.get("offset"), int) and old["offset"] <= st.st_size):
            old = {"run_dir": run_dir, "ino": st.st_ino, "offset": 0, "final": None, "best": None, "step": None}
        cur = dict(old)
        try:
            for end, rec in appended(path, cur["offset"]) if cur["offset"] < st.st_size else ():
                cur["offset"] = end
                if rec is None:
                    continue
                loss = rec.get("loss")
                if isinstance(rec.get("step"), int) and rec.get("event") in ("step", "save_start", "end"):
                    cur["step"] = max(cur["step"] or 0, rec["step"])
                if isinstance(loss, (int, float)) and math.isfinite(loss):
                    cur["final"] = float(loss)
                    cur["best"] = cur["final"] if cur["best"] is None else min(cur["best"], cur["final"])
        except OSError:
            return old["final"], old["best"], old["step"]
        if cur != self.points.get(job_id):
            self.points[job_id] = cur
            self.changed = True
        return cur["final"], cur["best"], cur["step"]

    def save(self) -> None:
        if not self.changed:
            return
        from orchestrator.store import private_dir
        try:
            d = private_dir(self.path.parent)
            tmp = d / f".{self.path.name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(self.points, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError:  # (a read-only home: the next call reads again)
            pass


def table_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per point: overrides, job, state, step, final and best loss; sorted by final loss (none last)."""
    from orchestrator.store import JobStore
    from orchestrator import records
    from orchestrator.types import is_terminal
    store = JobStore()
    rows = []
    summaries = LossSummaries(doc["id"])
    for pt in doc.get("points") or []:
        rec = store.get(pt["job_id"])
        if rec is not None and not is_terminal(rec.state) and doc.get("backend") == "slurm":
            try:  # (no runner left: SLURM says how each point stands, and its end is recorded)
                rec = records.reconcile(rec)[0]
            except Exception:  # noqa: BLE001 - the table shows what the store knows
                pass
        final = best = step = None
        if rec is not None:
            final, best, step = summaries.of(pt["job_id"], rec.run_dir)
        rows.append({"point": f"p{pt['index']}", "overrides": pt["overrides"], "job": pt["job_id"],
                     "state": rec.state if rec else "NOT STARTED", "step": step, "final_loss": final,
                     "best_loss": best, "root_cause": (rec.root_cause if rec else None),
                     "stopped_early": pt.get("stopped_early"), "not_started": pt.get("not_started")})
    summaries.save()
    return sorted(rows, key=lambda r: (r["final_loss"] is None, r["final_loss"] or 0.0, r["point"]))


def sweep_text(doc: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def loss(v):
        return "-" if v is None else f"{v:.4f}"
    lines = [f"sweep {doc['id']}: {len(rows)} point(s), at most {doc.get('max_parallel')} at once",
             f"{'POINT':<6} {'STATE':<11} {'STEP':>6} {'FINAL':>8} {'BEST':>8}  OVERRIDES"]
    for r in rows:
        lines.append(f"{r['point']:<6} {r['state']:<11} {r['step'] if r['step'] is not None else '-':>6} "
                     f"{loss(r['final_loss']):>8} {loss(r['best_loss']):>8}  {' '.join(r['overrides'])}"
                     + (f"  (stopped early: {r['stopped_early']})" if r.get("stopped_early") else "")
                     + (f"  (did not start: {r['not_started']})" if r.get("not_started") else ""))
    return "\n".join(lines)


def cancel_reason(sweep_id: str, how: str) -> str:
    """The one cause every point of a cancelled sweep records: the sweep, and how it was cancelled."""
    return f"sweep {sweep_id} was cancelled: {how}"


def cancel(doc: dict[str, Any]) -> dict[str, str]:
    """Stop the sweep: its runner starts no more points (SIGTERM; it cancels the running ones), and every point
    still running is cancelled here too (a runner that is gone leaves them to us). Returns job -> final state."""
    from orchestrator import records
    from orchestrator.store import JobStore
    from orchestrator.types import is_terminal
    if doc.get("slurm_array"):  # the whole array first: no task starts any more, the running ones end
        try:
            records.cancel_array(records.cluster_of(doc["points"][0]["run_dir"]), str(doc["slurm_array"]))
        except Exception:  # noqa: BLE001 - ended already; each point is cancelled below as well
            pass
    why = cancel_reason(str(doc.get("id")), f"by the user (orchestrate cancel {doc.get('id')})")
    for pt in doc.get("points") or []:  # said before the runner is told: every point ends with this one cause
        rec = JobStore().get(pt["job_id"])
        if rec is not None and not is_terminal(rec.state):
            RunDir(rec.run_dir).request_cancel(why)
    pid = doc.get("runner_pid")
    if isinstance(pid, int) and pid > 0 and live_sweep_runner(doc) == pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    out = {}
    for pt in doc.get("points") or []:
        rec = JobStore().get(pt["job_id"])
        if rec is None:
            out[pt["job_id"]] = "NOT STARTED"
        elif is_terminal(rec.state):
            out[pt["job_id"]] = rec.state
        else:
            out[pt["job_id"]] = _cancel_point(rec, why)
    return out


def _cancel_point(rec, why: str) -> str:
    """records.cancel of one point; a SLURM task the array's scancel is ending already may refuse a second scancel: its
    end is then what SLURM says within a few seconds."""
    from orchestrator import records
    from orchestrator.errors import OrchestratorError
    from orchestrator.types import is_terminal
    try:
        return records.cancel(rec.id, by=why)
    except OrchestratorError:
        for _ in range(40):
            time.sleep(0.25)
            rec = records.reconcile(rec)[0]
            if is_terminal(rec.state):
                return rec.state
        raise


_POINT = re.compile(r"^(sweep-\d{8}-\d{6}-[0-9a-f]{4})-p(\d+)$")


@functools.lru_cache(maxsize=64)
def _sweep_doc(sweep_id: str) -> dict[str, Any] | None:
    return read_sweep(sweep_id)  # (once per sweep per `ls`)


def _rank0(run_dir: str) -> Path:
    """A point's rank 0 heartbeat file: what the sweep's curves, table and `ls` read of it."""
    return RunDir(run_dir).path(RunDir.heartbeat_rel(0))


def _last_loss(run_dir: str, tail: int = 4096) -> float | None:
    """Rank 0's latest finite loss from the end of its heartbeat file (`ls`: not the whole run's records)."""
    try:
        recs = read_tail(_rank0(run_dir), tail)
    except OSError:
        return None
    for rec in reversed(recs):
        loss = rec.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            return float(loss)
    return None


def point_of(job_id: str, run_dir: str) -> dict[str, Any] | None:
    """A job that is a point of a recorded sweep: {"sweep", "point", "overrides", "loss" (its last), "sweep_points",
    "sweep_parallel"}; None for any other job (or a sweep whose record is gone)."""
    m = _POINT.match(job_id)
    doc = _sweep_doc(m.group(1)) if m else None
    if not m or doc is None:
        return None
    index = int(m.group(2))
    pt = next((p for p in doc.get("points") or [] if p.get("index") == index), None)
    if pt is None:
        return None
    return {"sweep": doc["id"], "point": index, "overrides": list(pt.get("overrides") or []),
            "loss": _last_loss(run_dir), "sweep_points": len(doc.get("points") or []),
            "sweep_parallel": doc.get("max_parallel")}


def log_path(sweep_id: str) -> Path:
    """ORCHESTRATE_HOME/sweeps/<id>.log: a detached sweep's runner output (what a foreground one prints)."""
    return sweeps_dir() / f"{sweep_id}.log"


def detach(args, argv: list[str], say: Callable[[str], None] = print) -> int:
    """`submit --sweep ... --detach`: plan every point here (a bad point: exit 2, nothing started), then run this
    very submit (same sweep id, without --detach) as the sweep's runner in a session of its own, output to
    log_path; return once it has recorded the sweep. `orchestrate attach SWEEP_ID` follows it, `cancel` stops it."""
    from orchestrator.detach import start_background
    from orchestrator.store import private_dir
    sweep_id, planned, _ = plan_points(args, list(args.sweep))
    private_dir(sweeps_dir())
    child = [a for a in argv if a not in ("--detach", "-d")] + ["--sweep-id", sweep_id, "--color", "never"]
    log = log_path(sweep_id)
    return start_background(  # (the runner plans every point again before it records the sweep)
        child, log, lambda: read_sweep(sweep_id) is not None, f"sweep {sweep_id}", lambda pid: say(
            f"sweep {sweep_id}: {len(planned)} point(s), runs detached (runner pid {pid}, output {log}); follow it "
            f"with: orchestrate attach {sweep_id}"), wait_s=300)


def follow(doc: dict[str, Any], say: Callable[[str], None], poll_s: float = 0.5) -> bool:
    """`attach SWEEP_ID`: print the runner's output (log_path) from its start and as it comes, until the runner is
    gone. True when it ended (the table follows), False for a sweep that was not run detached (no log)."""
    log = log_path(doc["id"])
    if not log.exists():
        return False
    pid = int(doc.get("runner_pid") or 0)
    with open(log, "rb") as f:
        buf = b""
        while True:
            alive = live_sweep_runner(doc) == pid
            chunk = f.read()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                say(line.decode(errors="replace"))
            if not chunk and not alive:
                if buf:
                    say(buf.decode(errors="replace"))
                return True
            if not chunk:
                time.sleep(poll_s)

"""The public Python API (docs/api.md): submit a job, wait for it, read its status, logs and result, cancel it, run a
sweep, list jobs, render a plan. What `import orchestrator` exports (`orchestrator.__all__`); the CLI and the
dashboard are its clients, so they cannot disagree with it.

One code path: a job is planned by orchestrator.api.prepare (the same validation as the CLI: every problem at once,
one ConfigError), run by orchestrator.running (in this process, or in a detached supervisor started by the same
machinery as `orchestrate submit --detach`), and read back through orchestrator.records and the CLI's readers
(views' status data, the log tail). A job given as a mapping is written to ORCHESTRATE_HOME/jobs/ as YAML and loaded
from there, so it goes through the very loader a job file does (and a detached supervisor can read it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from orchestrator.errors import ConfigError, OrchestratorError, Problem
from orchestrator.types import is_terminal

POLL_S = 0.5  # how often wait() / logs(follow=True) look at the store
RECONCILE_S = 10.0  # ... and how often they ask the backend (nobody may supervise the job any more)


class JobFailed(OrchestratorError):
    """`wait(raise_on_failure=True)` of a job that did not complete: `.status` is its final Status."""

    def __init__(self, status: Status):
        super().__init__(f"job {status.job} {status.state}" + (f": {status.root_cause}" if status.root_cause else ""))
        self.status = status


# ------------------------------------------------------------------------------------------- typed status

@dataclass(frozen=True)
class NodeStatus:
    """One node of a job, as `status --json` lists it under "nodes"."""
    node: int
    host: str
    ranks: tuple[int, ...]
    end: str | None = None  # how it ended: completed, failed, cancelled, lost (None: running / not known)
    exit_code: int | None = None
    signal: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class RankStatus:
    """One global rank, from its heartbeats, as `status --json` lists it under "ranks"."""
    rank: int
    host: str | None
    step: int | None
    max_steps: int | None
    loss: float | None
    tokens: int | None = None
    event: str | None = None
    heartbeat_age_s: float | None = None
    losses: tuple[float, ...] = ()


@dataclass(frozen=True)
class Status:
    """What `orchestrate status JOB --json` prints, typed; `data` is that very dict (every key, also those not
    typed here)."""
    job: str
    state: str
    backend: str
    cluster: str
    run_dir: str
    nodes: tuple[NodeStatus, ...]
    ranks: tuple[RankStatus, ...]
    restarts: int
    exit_code: int | None
    root_cause: str | None
    created: float
    updated: float
    data: dict[str, Any] = dataclasses.field(repr=False, compare=False, default_factory=dict)

    @property
    def done(self) -> bool:
        return is_terminal(self.state)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Status:
        def pick(klass, row: dict[str, Any]):
            names = {f.name for f in dataclasses.fields(klass)}
            kw = {k: v for k, v in row.items() if k in names}
            for k in ("ranks", "losses"):
                if k in kw and isinstance(kw[k], list):
                    kw[k] = tuple(kw[k])
            return klass(**kw)
        return cls(job=d["job"], state=d["state"], backend=d["backend"], cluster=d["cluster"], run_dir=d["run_dir"],
                   nodes=tuple(pick(NodeStatus, n) for n in d.get("nodes") or []),
                   ranks=tuple(pick(RankStatus, r) for r in d.get("ranks") or []), restarts=d.get("restarts") or 0,
                   exit_code=d.get("exit_code"), root_cause=d.get("root_cause"), created=d["created"],
                   updated=d["updated"], data=d)


@dataclass(frozen=True)
class Result:
    """How a job ended, for the next step of a pipeline: the state, the loss, the steps and where the model is.
    `checkpoint` is the last complete checkpoint (a fetched copy on this machine when outputs.fetch brought it back),
    else the output dir when the job wrote there."""
    job: str
    state: str
    steps: int | None
    final_loss: float | None
    first_loss: float | None
    checkpoint: str | None
    output_dir: str | None


@dataclass(frozen=True)
class Rendered:
    """What `render` plans: the plan (plan.json's data) and every file the job would write, by relative path. Of a
    sweep: `plan` is sweep.json's data (its id, max_parallel, points), `points` each point's own Rendered, and `files`
    every point's under p<i>/ (and on SLURM job.sbatch: the array job)."""
    plan: dict[str, Any]
    files: dict[str, str]
    _prepared: Any = dataclasses.field(repr=False, compare=False, default=None)
    points: tuple[Rendered, ...] = ()

    def write(self, out: str | os.PathLike[str], *, force: bool = False) -> Path:
        """Write the files to `out` (owner-only), as `orchestrate render --out` does; returns the directory. A
        directory holding another plan, or files render does not write, is refused (ConfigError) unless `force`,
        which removes only render's own files there (orchestrator.renderdir)."""
        from orchestrator import renderdir
        plan = self.points[0].plan if self.points else self.plan
        return renderdir.write(self.files, out, self.plan.get("id") or plan["job_id"], plan["recipe_name"],
                               force=force)


# ------------------------------------------------------------------------------------------- the job

class Job:
    """A recorded job, from this process or any other (the CLI, a notebook, a detached supervisor)."""

    def __init__(self, job_id: str):
        self.id = job_id
        self._run_dir: str | None = None
        self._rec: Any = None  # (jobs(): the record it was listed with)

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Job) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @classmethod
    def attach(cls, job_id: str) -> Job:
        """A job submitted elsewhere (CLI, another process), by id or a unique prefix; ConfigError when none."""
        from orchestrator import records
        return cls(records._record(job_id).id)

    def _record(self):
        from orchestrator import records
        return records._record(self.id)

    @property
    def state(self) -> str:
        """The store's state now (PENDING, QUEUED, RUNNING, RESTARTING, COMPLETED, FAILED, CANCELLED)."""
        return self._record().state

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            self._run_dir = self._record().run_dir
        return Path(self._run_dir)

    @property
    def output_dir(self) -> Path | None:
        """Where the job writes its model and checkpoints (as its ranks see it)."""
        from orchestrator.node.rundir import RunDir
        try:
            out = RunDir(self.run_dir).read_json("plan.json").get("output_dir")
        except (AttributeError, OSError, ValueError):
            return None
        return Path(out) if out else None

    def status(self) -> Status:
        """Every node and rank now, as `orchestrate status JOB --json` (the store reconciled with the backend when
        nobody supervises the job)."""
        return Status.from_dict(status_data(self.id))

    def wait(self, timeout: float | None = None, *, raise_on_failure: bool = False) -> Status:
        """Block until the job ends; returns its final Status. A FAILED or CANCELLED job raises nothing unless
        `raise_on_failure` (JobFailed). TimeoutError after `timeout` seconds. Ctrl-C (KeyboardInterrupt) stops the
        wait, not the job."""
        from orchestrator import records
        from orchestrator.store import JobStore
        deadline = None if timeout is None else time.monotonic() + timeout
        asked = time.monotonic()
        state = records.reconcile(self._record())[0].state
        while not is_terminal(state):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} still {state} after {timeout} s")
            time.sleep(POLL_S)
            rec = JobStore().get(self.id)
            if rec is None:
                raise OrchestratorError(f"job {self.id}: its record is gone")
            state = rec.state
            if time.monotonic() - asked > RECONCILE_S:
                asked = time.monotonic()
                state = records.reconcile(rec)[0].state
        st = self.status()
        if raise_on_failure and st.state != "COMPLETED":
            raise JobFailed(st)
        return st

    def logs(self, rank: int | None = None, follow: bool = False, *, node: int | None = None,
             grep: str | None = None) -> Iterator[str]:
        """The job's output lines, prefixed `[host nodeR rankG]` as `orchestrate logs` prints them: every node's,
        or one global `rank`'s, or one `node`'s, only those matching the regular expression `grep`. `follow`:
        keep yielding until the job ends."""
        from orchestrator import records
        from orchestrator.cli.logtail import LogTail
        from orchestrator.store import JobStore
        rec = self._record()
        tail = LogTail(rec.run_dir, node=node, rank=rank, grep=grep)
        yield from tail.lines()
        asked = time.monotonic()
        while follow:
            state = JobStore().get(rec.id).state
            if time.monotonic() - asked > RECONCILE_S:  # nobody may be supervising it any more: ask its backend
                asked = time.monotonic()
                state = records.reconcile(JobStore().get(rec.id))[0].state
            time.sleep(POLL_S)
            yield from tail.lines()
            if is_terminal(state):
                break

    def cancel(self) -> str:
        """Cancel the job from any process: every process on every node stopped, recorded CANCELLED. Returns the
        final state (a job that had ended already: its state)."""
        from orchestrator import records
        return records.cancel(self._record().id)

    def result(self) -> Result:
        """The loss, the steps and the checkpoint of the job (so far, while it runs): the trainer's own summary
        (ORCHESTRATE_RESULT of the recipes), else rank 0's last heartbeat and the output dir's last checkpoint."""
        rec = self._record()
        found = _result_line(Path(rec.run_dir))
        steps, final, first = found.get("global_step"), found.get("final_loss"), found.get("first_loss")
        if steps is None or final is None:
            beat = _last_beat(Path(rec.run_dir))
            steps = steps if steps is not None else beat.get("step")
            final = final if final is not None else beat.get("loss")
        out = found.get("output_dir") or (str(self.output_dir) if self.output_dir else None)
        ck = found.get("last_checkpoint")
        if not ck and out:
            from orchestrator.node.hooks import orchestrate_checkpoint as oc
            ck = oc.latest_complete(out, say=False) or (out if Path(out).is_dir() else None)
        if ck:
            from orchestrator.cli.views import local_copy
            ck = local_copy(str(ck), Path(rec.run_dir))
        return Result(job=rec.id, state=rec.state, steps=steps, final_loss=final, first_loss=first,
                      checkpoint=ck or None, output_dir=out)

    def summary(self) -> dict[str, Any]:
        """The row `orchestrate ls --json` prints for this job (without its place in the queue): its record, latest
        step and sweep point (when it is one). Of a Job from jobs(): its record as jobs() read it."""
        from orchestrator.cli.views import last_step
        from orchestrator.sweeps import point_of
        rec = self._rec or self._record()
        return dict(rec.to_dict(), step=last_step(rec.run_dir), **(point_of(rec.id, rec.run_dir) or {}))


def status_data(job: str) -> dict[str, Any]:
    """The dict `orchestrate status JOB --json` prints (Status.data)."""
    from orchestrator import records, running
    from orchestrator.cli.views import job_status
    rec, backend = records.status(job)
    queue = running.queue_positions() if rec.state == "QUEUED" else {}
    st = job_status(dict(rec.to_dict(), queue_position=queue.get(rec.id)))
    if backend is not None and (backend.detail or backend.reason):
        st["scheduler"] = f"{backend.state} ({backend.detail or backend.reason})"
    return st


def _result_line(run_dir: Path, tail: int = 1 << 16) -> dict[str, Any]:
    """The last ORCHESTRATE_RESULT {json} rank 0 printed (the end of node 0's log), {} when none."""
    from orchestrator.node.ranklines import split_rank
    path = run_dir / "logs" / "node0.log"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail))
            text = f.read().decode(errors="replace")
    except OSError:
        return {}
    for line in reversed(text.splitlines()):
        _, body = split_rank(line)
        if body.startswith("ORCHESTRATE_RESULT "):
            try:
                data = json.loads(body.split(" ", 1)[1])
            except ValueError:
                continue
            return data if isinstance(data, dict) else {}
    return {}


def _last_beat(run_dir: Path) -> dict[str, Any]:
    """Rank 0's latest heartbeat with a step ({} when none)."""
    from orchestrator.node.heartbeat import read_tail
    from orchestrator.node.rundir import RunDir
    try:
        beats = read_tail(RunDir(run_dir).path(RunDir.heartbeat_rel(0)), 8192)
    except OSError:
        return {}
    return next((b for b in reversed(beats) if b.get("step") is not None), {})


# ------------------------------------------------------------------------------------------- submit

def job_file(job: str | os.PathLike[str] | Mapping[str, Any]) -> str:
    """The job as a file the loader reads: a path as given; a mapping written (YAML, owner-only) to
    ORCHESTRATE_HOME/jobs/<digest>/<name>.yaml, where its `name` key (taken out; default "job") names the job as a
    file's name does."""
    if isinstance(job, (str, os.PathLike)):
        return os.fspath(job)
    if not isinstance(job, Mapping):
        raise ConfigError(Problem("job", f"a path or a mapping, got {type(job).__name__}"))
    import yaml
    from orchestrator.store import home, private_dir, write_private
    data = dict(job)
    name = str(data.pop("name", None) or "job")
    text = yaml.safe_dump(data, sort_keys=False)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".")[:60] or "job"
    digest = hashlib.sha256(f"{safe}\n{text}".encode()).hexdigest()[:16]
    path = private_dir(home() / "jobs" / digest) / f"{safe}.yaml"
    if not path.exists():
        write_private(path, text)
    return str(path)


def dotlist(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    """{dotted key: value} as the CLI's `key=value` overrides, each value written as JSON, which the dotlist reads
    back as the same value (a string stays a string); `key=value` strings (the CLI's own) as they are."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides):
        return list(overrides)
    raise ConfigError(Problem("overrides", "a mapping of dotted keys to values, e.g. {'trainer.max_steps': 10} "
                                           "(or a list of 'key=value' strings)"))


def _prepare(job, *, nodes=None, cluster=None, profile=None, overrides=None, procs_per_node=None, run_dir=None,
             probe=True):
    from orchestrator import api
    path = job_file(job)
    return path, api.prepare(path, None if cluster is None else os.fspath(cluster), nodes=nodes,
                             procs_per_node=procs_per_node, profile=profile, overrides=dotlist(overrides),
                             run_dir=run_dir, probe=probe)


def _flags(path: str, overrides: list[str], nodes, cluster, profile, procs_per_node) -> list[str]:
    """`orchestrate submit` arguments for the same job (what a detached supervisor re-runs)."""
    argv = ["submit", path, *overrides]
    for flag, value in (("--nodes", nodes), ("--procs-per-node", procs_per_node), ("--profile", profile),
                        ("--cluster", None if cluster is None else os.fspath(cluster))):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def submit(job: str | os.PathLike[str] | Mapping[str, Any], *, nodes: int | None = None,
           cluster: str | os.PathLike[str] | None = None, profile: str | None = None,
           overrides: Mapping[str, Any] | Sequence[str] | None = None, detach: bool = True,
           procs_per_node: int | None = None) -> Job:
    """Validate, plan and start a job; returns its Job. `job`: a job file's path or a mapping of the same schema;
    `overrides`: {dotted key: value} (`cluster.<key>` overrides the cluster file). Every problem at once: one
    ConfigError, its `.problems` the list of (where, message), before anything starts.

    detach=True (default): returns once the job is recorded; a supervisor of its own (the one of `orchestrate
    submit --detach`) runs it, and it survives this process. detach=False: this process supervises it to its end
    (Ctrl-C cancels the job, as an attached `orchestrate submit`) and the Job returned has ended."""
    if sweep_block(job_file(job)) is not None:  # (`orchestrate submit` of such a file runs the sweep)
        raise ConfigError(Problem("sweep", "this job has a sweep: block: run it with orchestrator.sweep(job, {})"))
    path, prepared = _prepare(job, nodes=nodes, cluster=cluster, profile=profile, overrides=overrides,
                              procs_per_node=procs_per_node)
    if detach:
        from orchestrator.detach import detach as start
        argv = _flags(path, dotlist(overrides), nodes, cluster, profile, procs_per_node)
        if start(argv, prepared, say=lambda _line: None) != 0:
            raise OrchestratorError(f"job {prepared.plan.job_id} did not start (its supervisor's output: "
                                    f"ORCHESTRATE_HOME/supervisors/{prepared.plan.job_id}.log)")
        return Job(prepared.plan.job_id)
    from orchestrator import running
    running.supervise_here(prepared, signals=_cancel_on_signals)
    return Job(prepared.plan.job_id)


def _cancel_on_signals(sup):
    """While this process supervises a job: Ctrl-C (SIGINT) and SIGTERM (`cancel` from another process) cancel it.
    Only in the main thread (elsewhere Python has no handlers to set); returns what puts the old handlers back."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return None
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, _frame) -> None:
        from orchestrator.node.rundir import RunDir
        req = RunDir(sup.plan.run_dir).cancel_request() if signum == signal.SIGTERM else None
        sup.request_cancel((req or {}).get("by") or ("interrupted (Ctrl-C)" if signum == signal.SIGINT
                                                     else "the supervising process got SIGTERM"))

    for s in old:
        signal.signal(s, handler)
    return lambda: [signal.signal(s, h) for s, h in old.items()]


def render(job: str | os.PathLike[str] | Mapping[str, Any], *, nodes: int | None = None,
           cluster: str | os.PathLike[str] | None = None, profile: str | None = None,
           overrides: Mapping[str, Any] | Sequence[str] | None = None, procs_per_node: int | None = None,
           run_dir: str | None = None, grid: Mapping[str, Any] | Sequence[str] | None = None,
           max_parallel: int | None = None, probe: bool = False) -> Rendered:
    """The plan and every file the job would write, without writing anything (Rendered.write(dir) writes them).
    The same validation as submit. A sweep (`grid`: as sweep()'s, or `--sweep` options "KEY=VALUES"; or the job
    file's `sweep:` block): every point planned, each point's files under p<i>/ with its run dir RUN_DIR/p<i>, on
    SLURM the array job's script job.sbatch naming them (`sbatch RUN_DIR/job.sbatch` runs the sweep). Nothing touches
    the network: a fact only the SSH hosts know (their GPU counts, container runtimes) is a ConfigError naming it and
    how to give it, unless `probe` (then the hosts are asked, as submit does)."""
    import types
    path = job_file(job)
    options, max_parallel, _ = _sweep_options(path, grid, max_parallel, None)
    if not options:
        if max_parallel is not None:
            raise ConfigError(Problem("max_parallel", "only with a sweep (a grid, or a sweep: block in the job file)"))
        _, prepared = _prepare(path, nodes=nodes, cluster=cluster, profile=profile, overrides=overrides,
                               procs_per_node=procs_per_node, run_dir=run_dir, probe=probe)
        return Rendered(plan=json.loads(prepared.plan.to_json()), files=dict(prepared.files), _prepared=prepared)
    from orchestrator import sweeps
    args = types.SimpleNamespace(recipe=path, cluster=None if cluster is None else os.fspath(cluster), nodes=nodes,
                                 procs_per_node=procs_per_node, profile=profile, overrides=dotlist(overrides),
                                 max_parallel=max_parallel, dry_run=True, probe=probe)
    _, planned, files = sweeps.render(args, options, run_dir)
    points = tuple(Rendered(plan=json.loads(p.plan.to_json()), files=dict(p.files), _prepared=p)
                   for *_, p in planned)
    return Rendered(plan=json.loads(files[sweeps.SWEEP_FILE]), files=files, points=points)


def _sweep_options(path: str, grid: Mapping[str, Any] | Sequence[str] | None, max_parallel: int | None,
                   stop_if_worse: float | None) -> tuple[list[str], int | None, float | None]:
    """(--sweep options, max_parallel, stop_if_worse) of a sweep: `grid` ({dotted key: values}, or --sweep options)
    over the job file's `sweep:` block (a key in both: grid's values), the given numbers over the block's."""
    from orchestrator.core.sweep import block_options, merge_options
    if grid is None:
        options: list[str] = []
    elif isinstance(grid, Mapping):
        options = block_options(grid)
    elif isinstance(grid, (list, tuple)) and all(isinstance(o, str) for o in grid):
        options = list(grid)
    else:
        raise ConfigError(Problem("grid", "a mapping of dotted keys to lists of values (or 'KEY=V1,V2' strings)"))
    file_block = sweep_block(path)
    if file_block is not None:
        options = merge_options(block_options(file_block.grid), options)
        max_parallel = file_block.max_parallel if max_parallel is None else max_parallel
        stop_if_worse = file_block.stop_if_worse if stop_if_worse is None else stop_if_worse
    return options, max_parallel, stop_if_worse


def jobs(limit: int | None = 20, *, state: str | None = None) -> list[Job]:
    """The latest `limit` jobs of this store (None: all), newest first, each reconciled with its backend; `state`:
    only those in that state."""
    from orchestrator import records
    return [_known(Job(r.id), r.run_dir, r) for r in records.jobs(limit) if state is None or r.state == state]


def _known(job: Job, run_dir: str, rec: Any = None) -> Job:
    job._run_dir, job._rec = run_dir, rec
    return job


# ------------------------------------------------------------------------------------------- sweeps

class Sweep:
    """A grid of jobs (one per point), run at most max_parallel at once by a sweep runner."""

    def __init__(self, sweep_id: str):
        self.id = sweep_id

    def __repr__(self) -> str:
        return f"Sweep({self.id!r})"

    @classmethod
    def attach(cls, sweep_id: str) -> Sweep:
        from orchestrator.sweeps import read_sweep
        if read_sweep(sweep_id) is None:
            raise ConfigError(Problem(sweep_id, "no such sweep (ORCHESTRATE_HOME/sweeps)"))
        return cls(sweep_id)

    def doc(self) -> dict[str, Any]:
        """The sweep's record (ORCHESTRATE_HOME/sweeps/<id>.json: its grid, points, runner)."""
        from orchestrator.sweeps import read_sweep
        doc = read_sweep(self.id)
        if doc is None:
            raise ConfigError(Problem(self.id, "no such sweep (ORCHESTRATE_HOME/sweeps)"))
        return doc

    @property
    def jobs(self) -> list[Job]:
        """One Job per point, in the grid's order (a point not started yet has no record: its `state` raises)."""
        return [_known(Job(p["job_id"]), p["run_dir"]) for p in self.doc().get("points") or []]

    @property
    def points(self) -> list[dict[str, Any]]:
        """{index, overrides, job_id, run_dir} of each point."""
        return list(self.doc().get("points") or [])

    def table(self) -> list[dict[str, Any]]:
        """What `orchestrate sweep ID --json` lists under "points": one row per point (state, step, final and best
        loss), sorted by final loss."""
        from orchestrator.sweeps import table_rows
        return table_rows(self.doc())

    def running(self) -> bool:
        """Its runner is still at work (points left to start or to end)."""
        from orchestrator.detach import live_sweep_runner
        return live_sweep_runner(self.doc()) is not None

    def wait(self, timeout: float | None = None, *, raise_on_failure: bool = False) -> list[dict[str, Any]]:
        """Block until the runner is done and every point has ended; returns table(). `raise_on_failure`: JobFailed
        for the first point that did not complete. Ctrl-C stops the wait, not the sweep."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rows = self.table()
            if not self.running() and all(is_terminal(r["state"]) or r["state"] == "NOT STARTED" for r in rows):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"sweep {self.id} still running after {timeout} s")
            time.sleep(POLL_S)
        if raise_on_failure:
            bad = next((r for r in rows if r["state"] != "COMPLETED"), None)
            if bad is not None:
                raise JobFailed(Job(bad["job"]).status()) if bad["state"] != "NOT STARTED" else \
                    OrchestratorError(f"sweep {self.id}: point {bad['point']} did not start: {bad.get('not_started')}")
        return rows

    def logs(self, rank: int | None = None, follow: bool = False, *, node: int | None = None,
             grep: str | None = None) -> Iterator[str]:
        """Every point's output lines as Job.logs gives them (the same `rank`, `node`, `grep`), each prefixed
        `[p<i>]` as the sweep's runner prints them; point by point, or with `follow` as they come until the runner is
        done and every point has ended."""
        from orchestrator import records
        from orchestrator.cli.logtail import LogTail
        from orchestrator.store import JobStore
        tails: dict[int, LogTail] = {}
        asked = time.monotonic()
        while True:
            done = not follow or not self.running()
            ask = follow and time.monotonic() - asked > RECONCILE_S  # nobody may supervise a point any more
            asked = time.monotonic() if ask else asked
            store = JobStore()
            for pt in self.points:
                rec = store.get(pt["job_id"])
                if rec is None:  # not started (yet: while the runner runs, `done` is False anyway)
                    continue
                if ask and not is_terminal(rec.state):
                    rec = records.reconcile(rec)[0]
                done = done and is_terminal(rec.state)
                tail = tails.setdefault(pt["index"], LogTail(rec.run_dir, node=node, rank=rank, grep=grep))
                for line in tail.lines():
                    yield f"[p{pt['index']}] {line}"
            if done:
                return
            time.sleep(POLL_S)

    def cancel(self) -> dict[str, str]:
        """Stop the sweep: no more points start, the running ones are cancelled. Returns {job id: final state}."""
        from orchestrator import sweeps
        return sweeps.cancel(self.doc())


def find(id: str) -> Job | Sweep:
    """The job (by id or a unique prefix) or the sweep (by id) that `id` names, as `status`, `logs`, `attach`, `plot`
    and `cancel` take either; ConfigError "no job or sweep ID" when there is neither."""
    from orchestrator.store import JobStore
    from orchestrator.sweeps import read_sweep
    if id.startswith("sweep-") and "/" not in id and read_sweep(id) is not None:
        return Sweep(id)
    rec = JobStore().get(id)
    if rec is None:
        raise ConfigError(f"no job or sweep {id!r} (see `orchestrate ls`)")
    return Job(rec.id)


def sweep(job: str | os.PathLike[str] | Mapping[str, Any], grid: Mapping[str, Any], *,
          max_parallel: int | None = None, nodes: int | None = None, cluster: str | os.PathLike[str] | None = None,
          profile: str | None = None, overrides: Mapping[str, Any] | Sequence[str] | None = None,
          stop_if_worse: float | None = None, procs_per_node: int | None = None, detach: bool = True) -> Sweep:
    """One job per combination of `grid`'s values ({dotted key: [values]}; the job's own `sweep:` block too, `grid`
    winning on a key; `{}`: the block alone), at most `max_parallel` at once; `stop_if_worse`: cancel a point whose
    loss is NaN or above that factor times the best point's at the same step. Every point is planned first: a bad
    one raises ConfigError naming it, nothing started. detach=True: a runner of its own runs it (it survives this
    process); False: this process runs it to the end."""
    import types
    from orchestrator import sweeps
    if not isinstance(grid, Mapping):
        raise ConfigError(Problem("grid", "a mapping of dotted keys to lists of values"))
    if stop_if_worse is not None and not stop_if_worse > 1:
        raise ConfigError(Problem("stop_if_worse", f"must be a number > 1, got {stop_if_worse}"))
    path = job_file(job)
    if not grid and sweep_block(path) is None:
        raise ConfigError(Problem("grid", "empty, and the job has no sweep: block: nothing to sweep"))
    options, max_parallel, stop_if_worse = _sweep_options(path, grid, max_parallel, stop_if_worse)
    overrides_list = dotlist(overrides)
    args = types.SimpleNamespace(recipe=path, cluster=None if cluster is None else os.fspath(cluster), nodes=nodes,
                                 procs_per_node=procs_per_node, profile=profile, overrides=overrides_list,
                                 max_parallel=max_parallel, stop_if_worse=stop_if_worse, quiet=True, no_wait=False,
                                 job_id=None, sweep=options, sweep_id=sweeps.new_sweep_id())
    if detach:
        argv = _flags(path, overrides_list, nodes, cluster, profile, procs_per_node)
        argv += [a for o in options for a in ("--sweep", o)] + ["--quiet"]
        argv += ["--max-parallel", str(max_parallel)] if max_parallel is not None else []
        argv += ["--stop-if-worse", str(stop_if_worse)] if stop_if_worse is not None else []
        if sweeps.detach(args, argv, say=lambda _line: None) != 0:
            raise OrchestratorError(f"the runner of sweep {args.sweep_id} did not start (its output: "
                                    f"{sweeps.log_path(args.sweep_id)})")
    else:
        sweeps.run(args, options, say=lambda _line: None)
    return Sweep(args.sweep_id)


def sweep_block(path: str):
    """The job file's `sweep:` block (core.spec.SweepSpec), None when it has none; ConfigError naming its problems."""
    from orchestrator.core.schema import build
    from orchestrator.core.spec import SweepSpec, read_yaml, sweep_problems
    data = read_yaml(path, "recipe")
    if data.get("sweep") is None:
        return None
    spec, problems = build(SweepSpec, data["sweep"], "sweep")
    problems += sweep_problems(spec) if spec is not None else []
    if problems:
        raise ConfigError(problems, source=path)
    return spec

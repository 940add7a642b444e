"""`orchestrate gc`: remove finished jobs' run dirs and records, here and on the SSH hosts that ran them.

Which jobs: those of this store whose record is terminal (each asked of its backend first, `records.reconcile`, so a job
recorded as running whose supervisor died counts as what it really is), whose supervisor is gone, and that ended
more than `older_than` seconds ago (their record's last update before this gc asked); `keep_failed` keeps the FAILED
ones; `jobs` limits it to those ids (unique prefixes accepted). Every other job is left alone; the ones not finished,
still supervised, kept as FAILED, or that could not be cleaned everywhere are listed under `kept` with why.

What goes, per job: its run dir (ORCHESTRATE_HOME/runs/<job>, or slurm.workdir/runs/<job> on the shared filesystem),
its detached supervisor's log, the job file the Python API wrote for a job given as a mapping
(ORCHESTRATE_HOME/jobs/<digest>/, when no kept job names it), and last its store record. Then each sweep none of
whose points is left in the store (and whose runner is gone): its record, log, plot and SLURM array folder
(`sweep_items`). For an SSH job without a shared filesystem, first each host's WORKDIR/runs/<job> and the staging
cache trees and blobs that no other run dir on that host names (the host side is orchestrator/node/hostgc.py, sent
over SSH as source, so it runs where orchestrate is not installed). Output dirs only with `outputs` (the local one,
and on SSH hosts WORKDIR/outputs/<key>), and only when no kept job of this store (or, on a host, no other run dir)
uses the same one.
A job whose hosts could not all be cleaned keeps its run
dir and record (they say where its hosts are), so the next gc finishes it.

`dry_run` computes and returns exactly the same items and removes nothing; `local_only` asks no host (for hosts gone
for good: what they hold for those jobs stays there). Every item: job, where (`local` or the
host), what, path, bytes.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from orchestrator.errors import ConfigError, Problem
from orchestrator.node.hostgc import du  # (bytes of a directory: the same count here and on the hosts)
from orchestrator.node.rundir import RunDir
from orchestrator.types import JobState, is_terminal

DEFAULT_OLDER_THAN = "30d"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_age(text: str) -> float:
    """`30d`, `12h`, `90m`, `45s`, `2w`, `0` -> seconds; ConfigError (exit 2) naming --older-than otherwise."""
    m = _AGE.match(str(text))
    if not m:
        raise ConfigError(Problem("--older-than", f"not an age: {text!r} (e.g. 30d, 12h, 90m, 0)"))
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Freed:
    """One thing gc removes (or, in a dry run, would remove)."""

    job: str  # the job id; "" for a host's shared staging cache
    where: str  # "local" or the SSH host
    what: str  # run dir | supervisor log | outputs | cache
    path: str
    bytes: int
    detail: str = ""  # cache: how many trees and blobs
    error: str = ""  # set when the removal failed


@dataclass
class Report:
    dry_run: bool
    items: list[Freed] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # jobs whose records are (would be) gone
    kept: dict[str, str] = field(default_factory=dict)  # job -> why it was left alone
    newer: int = 0  # finished jobs younger than the cutoff (left alone, not listed)

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items if not i.error)

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "bytes": self.bytes, "items": [asdict(i) for i in self.items],
                "jobs": list(self.removed), "kept": dict(self.kept), "newer": self.newer}


# ------------------------------------------------------------------------------------------- which jobs

def select(older_than_s: float, keep_failed: bool, jobs: tuple[str, ...] = (),
           progress: Callable[[str], None] | None = None) -> tuple[list, dict[str, str], int]:
    """(records to remove, {job: why kept}, how many finished jobs are newer than the cutoff)."""
    from orchestrator import records
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore
    store = JobStore()
    if jobs:
        recs = []
        for j in jobs:
            rec = store.get(j)
            if rec is None:
                raise ConfigError(Problem(j, "no such job (or the prefix is not unique); see `orchestrate ls`"))
            recs.append(rec)
    else:
        recs = store.list(None)
    last_news = {r.id: r.updated for r in recs}  # (a job reconciled now ended when it was last heard of)
    unsure = [r for r in recs if not is_terminal(r.state)]
    if unsure and progress:
        progress(f"asking the backends of {len(unsure)} unfinished job(s) how they stand")
    if jobs:
        recs = [records.reconcile(r)[0] for r in recs]
    else:
        recs = records.jobs(None) if unsure else recs  # (every record, the unfinished ones asked at once)
    chosen, kept, newer = [], {}, 0
    now = time.time()
    for rec in recs:
        if not is_terminal(rec.state):
            kept[rec.id] = f"not finished ({rec.state})"
        elif live_supervisor(rec.id) is not None:
            kept[rec.id] = "its supervisor still runs"
        elif keep_failed and rec.state == JobState.FAILED.value:
            kept[rec.id] = "FAILED (--keep-failed)"
        elif now - last_news.get(rec.id, rec.updated) < older_than_s:
            newer += 1
        else:
            chosen.append(rec)
    return chosen, kept, newer


# ------------------------------------------------------------------------------------------- what, where

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ssh_places(rec) -> tuple[Any, list[tuple[str, str]]]:
    """(the job's ssh block, [(host, its workdir)]) for an SSH job whose hosts hold a run dir of their own (no
    shared filesystem); (None, []) for every other job. From the run dir: cluster.json, handle.json, staged.json."""
    from orchestrator.core.spec import cluster_from_dict
    rd = RunDir(rec.run_dir)
    cluster = _read_json(rd.path(RunDir.CLUSTER))
    if not isinstance(cluster, dict) or cluster.get("kind") != "ssh":
        return None, []
    spec = cluster_from_dict(cluster)
    if spec.ssh is None or spec.ssh.shared_fs:
        return None, []
    places: dict[str, str] = {}
    handle = _read_json(rd.path(RunDir.HANDLE)) or {}
    suffix = f"/runs/{rec.id}"
    for n in ((handle.get("data") or {}).get("nodes") or []) if isinstance(handle, dict) else []:
        if isinstance(n, dict) and str(n.get("run_dir", "")).endswith(suffix):
            places[n["host"]] = n["run_dir"][:-len(suffix)]
    staged = _read_json(rd.path("staged.json")) or {}
    for host, facts in (staged.get("hosts") or {}).items() if isinstance(staged, dict) else []:
        if isinstance(facts, dict) and facts.get("workdir"):
            places.setdefault(host, facts["workdir"])
    return spec.ssh, sorted(places.items())


def local_output_dir(rec) -> str | None:
    """Where the job's outputs are on this machine: an SSH staged job's fetch target (stage.json), else the plan's
    output dir."""
    rd = RunDir(rec.run_dir)
    stage = _read_json(rd.path("stage.json"))
    if isinstance(stage, dict) and stage.get("output_local"):
        return str(stage["output_local"])
    plan = _read_json(rd.path(RunDir.PLAN))
    out = plan.get("output_dir") if isinstance(plan, dict) else None
    return out if isinstance(out, str) and out.startswith("/") else None


def _protected(path: Path) -> str | None:
    """Why an output dir may not be removed (it is /, or holds the home, ORCHESTRATE_HOME or the working dir)."""
    from orchestrator.store import home
    p = path.resolve()
    if p == Path(p.anchor):
        return "it is /"
    for name, other in (("your home", Path.home()), ("ORCHESTRATE_HOME", home()), ("the current directory",
                                                                                    Path.cwd())):
        try:
            other = other.resolve()
        except OSError:
            continue
        if other == p or p in other.parents:
            return f"it holds {name}"
    return None


# ------------------------------------------------------------------------------------------- the hosts

def _hostgc_source() -> str:
    from orchestrator.node import hostgc
    return Path(hostgc.__file__).read_text()


def ask_hosts(groups: dict, dry_run: bool, outputs: bool, progress: Callable[[str], None] | None = None
              ) -> dict[tuple[str, str], dict]:
    """Run hostgc on every (host, workdir): `groups` = {ssh block: {host: {workdir: [job ids]}}}. Returns
    {(host, workdir): its reply, or {"error": why}}."""
    out: dict[tuple[str, str], dict] = {}
    for ssh, hosts in groups.items():
        out.update(_ask_group(ssh, hosts, {"dry_run": dry_run, "outputs": outputs}, progress))
    return out


def _ask_group(ssh: Any, hosts: dict[str, dict[str, list[str]]], req: dict[str, Any],
               progress: Callable[[str], None] | None) -> dict[tuple[str, str], dict]:
    """hostgc on the hosts of one ssh block, a few at a time (the SSH pool's threads)."""
    from launchers.ssh.transport import Pool, remote_command
    source = _hostgc_source()
    try:
        pool = Pool(ssh)
    except (OSError, ValueError) as e:
        return {(host, wd): {"error": f"cannot connect: {e}"} for host, workdirs in hosts.items() for wd in workdirs}

    def one(host: str) -> dict[str, dict]:
        conn = pool.connect(host)
        answers = {}
        for wd, jobs in hosts[host].items():
            rc, stdout, stderr = conn.run(remote_command([str(ssh.python), "-c", source, wd]),
                                          stdin=(json.dumps(dict(req, remove=jobs)) + "\n").encode(), timeout=600)
            line = next((ln for ln in stdout.decode(errors="replace").splitlines() if ln.startswith("{")), "")
            if not line:
                tail = (stderr or stdout).decode(errors="replace").strip().splitlines()
                answers[wd] = {"error": f"exit {rc}" + (f": {tail[-1]}" if tail else "")}
            else:
                answers[wd] = json.loads(line)
        if progress:
            n = sum(len(j) for j in hosts[host].values())
            progress(f"{host}: {'looked at' if req['dry_run'] else 'cleaned'} {n} job(s)")
        return answers

    try:
        found = pool.map(one, list(hosts))
    finally:
        pool.close()
    return {(host, wd): ({"error": str(res) or type(res).__name__} if isinstance(res, Exception) else res[wd])
            for host, res in found.items() for wd in hosts[host]}


# ------------------------------------------------------------------------------------------- gc

def gc(older_than_s: float, keep_failed: bool = False, jobs: tuple[str, ...] = (), outputs: bool = False,
       dry_run: bool = False, local_only: bool = False, progress: Callable[[str], None] | None = None) -> Report:
    """Select, then remove (see the module docstring). Returns what was (or, `dry_run`, would be) freed.
    `local_only`: no SSH host is asked (hosts that are gone for good): what they hold for those jobs stays there."""
    from orchestrator.detach import live_supervisor
    from orchestrator.store import JobStore, home
    chosen, kept, newer = select(older_than_s, keep_failed, jobs, progress)
    report = Report(dry_run=dry_run, kept=kept, newer=newer)
    if not chosen:
        return _sweeps(report, dry_run)
    # the hosts first: a job whose hosts could not all be cleaned keeps what says where they are
    groups: dict[Any, dict[str, dict[str, list[str]]]] = {}
    for rec in chosen:
        ssh, where = ssh_places(rec) if not local_only else (None, [])
        for host, wd in where:
            groups.setdefault(ssh, {}).setdefault(host, {}).setdefault(wd, []).append(rec.id)
    if groups and progress:
        progress(f"asking {sum(len(h) for h in groups.values())} SSH host(s)")
    answers = ask_hosts(groups, dry_run, outputs, progress) if groups else {}
    failed: dict[str, str] = {}
    for (host, wd), ans in sorted(answers.items()):
        if "error" in ans:
            for job in groups_jobs(groups, host, wd):
                failed.setdefault(job, f"{host}: {ans['error']}")
            continue
        for job, why in ans.get("refused", {}).items():
            failed.setdefault(job, f"{host}: {why}")
        for it in ans.get("items", []):
            detail = f"{len(it.get('trees', []))} trees, {len(it.get('blobs', []))} blobs" if it["what"] == "cache" \
                else ""
            report.items.append(Freed(it["job"], host, it["what"], it["path"], int(it["bytes"]), detail,
                                      it.get("error", "")))
            if it.get("error") and it["job"]:
                failed.setdefault(it["job"], f"{host}: {it['error']}")
        if ans.get("note") and progress:
            progress(f"{host}: {ans['note']}")
    removed = {r.id for r in chosen}
    store = JobStore()
    kept_outputs = set()
    kept_files = {rec.recipe for rec in store.list(None) if rec.id not in removed}  # (job files still named)
    if outputs:
        for rec in store.list(None):
            if rec.id not in removed and (out := local_output_dir(rec)):
                kept_outputs.add(str(Path(out).resolve()))
    for rec in chosen:
        if rec.id in failed:
            report.kept[rec.id] = f"could not be cleaned everywhere ({failed[rec.id]}); run gc again"
            continue
        if live_supervisor(rec.id) is not None:  # (started again since it was selected: never)
            report.kept[rec.id] = "its supervisor still runs"
            continue
        items = _local_items(rec, outputs, kept_outputs, kept_files)
        ok = True
        for item in items:
            if not dry_run:
                try:
                    if Path(item.path).is_dir():
                        shutil.rmtree(item.path)
                    else:
                        Path(item.path).unlink(missing_ok=True)
                except OSError as e:
                    item = Freed(**dict(asdict(item), error=f"{e.strerror or e}"))
                    ok = False
            report.items.append(item)
        if ok and not dry_run:
            store.delete(rec.id)
            try:
                (home() / "supervisors" / f"{rec.id}.pid").unlink(missing_ok=True)
            except OSError:
                pass
        if ok:
            report.removed.append(rec.id)
        else:
            report.kept[rec.id] = "its local files could not all be removed; run gc again"
    return _sweeps(report, dry_run)


def _sweeps(report: Report, dry_run: bool) -> Report:
    """The sweeps left without a point (after this gc's removals): `sweep_items`, removed unless `dry_run`."""
    from orchestrator.store import JobStore
    remaining = {r.id for r in JobStore().list(None)} - set(report.removed)
    for item in sweep_items(remaining):
        if not dry_run:
            try:
                shutil.rmtree(item.path) if Path(item.path).is_dir() else Path(item.path).unlink(missing_ok=True)
            except OSError as e:
                item = Freed(**dict(asdict(item), error=f"{e.strerror or e}"))
        report.items.append(item)
    return report


def sweep_items(remaining: set[str]) -> list[Freed]:
    """What is left of the sweeps none of whose points is in the store any more (`remaining`: the job ids kept) and
    whose runner is gone: the record (ORCHESTRATE_HOME/sweeps/<id>.json), a detached runner's log, the plot, the loss
    summary (sweep.LossSummaries), and a SLURM sweep's array folder (<slurm.workdir>/sweeps/<id>: its script, SLURM's
    and submitit's files)."""
    from orchestrator.detach import live_sweep_runner
    from orchestrator.store import sweeps_dir
    out: list[Freed] = []
    d = sweeps_dir()
    for path in sorted(d.glob("sweep-*.json")) if d.is_dir() else []:
        doc = _read_json(path)
        if not isinstance(doc, dict) or doc.get("id") != path.stem:
            continue
        if any(pt.get("job_id") in remaining for pt in doc.get("points") or []) or live_sweep_runner(doc):
            continue
        sid = doc["id"]
        out.append(Freed(sid, "local", "sweep record", str(path), path.stat().st_size))
        for suffix, what in ((".log", "sweep log"), (".png", "sweep plot"), (".losses.json", "sweep loss summary")):
            extra = path.with_suffix(suffix)
            if extra.is_file():
                out.append(Freed(sid, "local", what, str(extra), extra.stat().st_size))
        folder = Path(doc["sbatch"]).parent if doc.get("sbatch") else None
        if folder is not None and folder.name == sid and folder.is_dir() and not folder.is_symlink():
            out.append(Freed(sid, "local", "sweep folder", str(folder), du(folder)))
    return out


def groups_jobs(groups: dict, host: str, wd: str) -> list[str]:
    return [j for hosts in groups.values() for j in hosts.get(host, {}).get(wd, [])]


def _local_items(rec, outputs: bool, kept_outputs: set[str], kept_files: set[str]) -> list[Freed]:
    from orchestrator.store import home
    items = []
    job_file = Path(rec.recipe)  # a job given to the Python API as a mapping: ORCHESTRATE_HOME/jobs/<digest>/<name>
    if job_file.parent.parent == home() / "jobs" and job_file.is_file() and rec.recipe not in kept_files:
        kept_files.add(rec.recipe)  # (listed once, with the first job that names it)
        items.append(Freed(rec.id, "local", "job file", str(job_file.parent), du(job_file.parent)))
    run_dir = Path(rec.run_dir)
    if run_dir.name == rec.id and run_dir.is_dir() and not run_dir.is_symlink():  # (a record naming another dir:
        items.append(Freed(rec.id, "local", "run dir", str(run_dir), du(run_dir)))  # never removed)
    log = home() / "supervisors" / f"{rec.id}.log"
    if log.is_file():
        items.append(Freed(rec.id, "local", "supervisor log", str(log), log.stat().st_size))
    out = local_output_dir(rec) if outputs else None
    if out:
        p = Path(out)
        if p.is_dir() and str(p.resolve()) not in kept_outputs and _protected(p) is None:
            kept_outputs.add(str(p.resolve()))  # (listed once, with the first job that names it)
            items.append(Freed(rec.id, "local", "outputs", str(p), du(p)))
    return items

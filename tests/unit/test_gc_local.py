"""`orchestrate gc` on this machine, through the real CLI and the real job store: finished jobs older than the cutoff
lose their run dir, supervisor log and record; a job still running or still supervised, a recent one and (with
--keep-failed) a failed one are left alone; output dirs go only with --outputs and only when no kept job uses them;
`--dry-run` lists exactly what the real run then removes. The records are made through the store's own API (their ages
set in the database: a record cannot be backdated otherwise); the SSH side: tests/staging/test_gc_hosts.py."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.node.proctools import process_start_time
from orchestrator.store import JobStore

DAY = 86400


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "gc", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ORCHESTRATE_HOME": str(home)})


def _job(home: Path, job: str, state: str, age_s: float = 0.0, output_dir: Path | None = None,
         backend: str = "local") -> Path:
    """A job record (create + update through JobStore) with a run dir of a few files, `age_s` old."""
    store = JobStore(home / "jobs.db")
    run = home / "runs" / job
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "node0.log").write_text("line\n" * 200)
    (run / "plan.json").write_text(json.dumps({"job_id": job, "output_dir": str(output_dir or home / "none")}))
    (run / "cluster.json").write_text(json.dumps({"kind": "local", "name": "local"}))
    store.create(job_id=job, recipe="job.yaml", recipe_digest="d", cluster="local", backend=backend, nodes=1,
                 world_size=1, run_dir=str(run))
    store.update(job, state, exit_code=0 if state == "COMPLETED" else 1)
    with sqlite3.connect(home / "jobs.db") as c:
        c.execute("UPDATE jobs SET updated=?, created=? WHERE id=?", (time.time() - age_s, time.time() - age_s, job))
    return run


@pytest.fixture
def supervisor():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _supervise(home: Path, job: str, proc) -> None:
    d = home / "supervisors"
    d.mkdir(exist_ok=True)
    start = None
    for _ in range(50):
        start = process_start_time(proc.pid)
        if start:
            break
        time.sleep(0.02)
    (d / f"{job}.pid").write_text(f"{proc.pid} {start:.3f}\n")


def test_gc_removes_old_finished_jobs_only_and_dry_run_lists_the_same(tmp_path, supervisor):
    home = tmp_path / "home"
    shared, own = tmp_path / "out-shared", tmp_path / "out-failed"
    for d in (shared, own):
        (d / "checkpoint-5").mkdir(parents=True)
        (d / "checkpoint-5" / "model.bin").write_bytes(b"m" * 5000)
    old_ok = _job(home, "old-ok", "COMPLETED", 2 * DAY, output_dir=shared)
    (home / "supervisors").mkdir()
    (home / "supervisors" / "old-ok.log").write_text("detached supervisor output\n")
    old_failed = _job(home, "old-failed", "FAILED", 3 * DAY, output_dir=own)
    fresh = _job(home, "fresh", "COMPLETED", 60)
    running = _job(home, "running", "RUNNING", 5 * DAY, output_dir=shared)
    _supervise(home, "running", supervisor)
    held = _job(home, "held", "CANCELLED", 4 * DAY)  # ended, but its supervisor process still runs: left alone
    _supervise(home, "held", supervisor)

    keep_failed = _cli(home, "--older-than", "1d", "--keep-failed", "--dry-run", "--json")
    assert keep_failed.returncode == 0, keep_failed.stderr
    k = json.loads(keep_failed.stdout)
    assert k["jobs"] == ["old-ok"] and k["kept"]["old-failed"] == "FAILED (--keep-failed)", k

    dry = _cli(home, "--older-than", "1d", "--outputs", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    d = json.loads(dry.stdout)
    assert sorted(d["jobs"]) == ["old-failed", "old-ok"] and d["newer"] == 1, d
    assert d["kept"] == {"running": "not finished (RUNNING)", "held": "its supervisor still runs"}
    assert {(i["job"], i["what"], i["path"]) for i in d["items"]} == {
        ("old-ok", "run dir", str(old_ok)), ("old-ok", "supervisor log", str(home / "supervisors" / "old-ok.log")),
        ("old-failed", "run dir", str(old_failed)), ("old-failed", "outputs", str(own))}  # not the shared output dir
    assert d["bytes"] == sum(i["bytes"] for i in d["items"]) and d["bytes"] > 5000
    assert old_ok.is_dir() and own.is_dir() and len(JobStore(home / "jobs.db").list(None)) == 5  # nothing removed

    real = _cli(home, "--older-than", "1d", "--outputs", "--json")
    assert real.returncode == 0, real.stderr
    r = json.loads(real.stdout)
    assert r["items"] == d["items"] and r["jobs"] == d["jobs"] and not r["dry_run"]
    assert not old_ok.exists() and not old_failed.exists() and not own.exists()
    assert not (home / "supervisors" / "old-ok.log").exists()
    assert fresh.is_dir() and running.is_dir() and held.is_dir() and (shared / "checkpoint-5" / "model.bin").is_file()
    left = {rec.id for rec in JobStore(home / "jobs.db").list(None)}
    assert left == {"fresh", "running", "held"}
    assert (home / "supervisors" / "running.pid").is_file()

    again = _cli(home, "--older-than", "1d", "--outputs")  # nothing left to do; the table's plain text
    assert again.returncode == 0 and "freed 0 B of 0 finished job(s) older than 1d" in again.stdout, again.stdout
    assert "left alone: 1 finished job(s) newer than 1d" in again.stdout
    assert "left alone: running: not finished (RUNNING)" in again.stdout


def test_gc_named_jobs_any_age_and_bad_input(tmp_path, supervisor):
    home = tmp_path / "home"
    fresh = _job(home, "fresh-1234", "COMPLETED", 5)
    running = _job(home, "running-1", "RUNNING", 0)
    _supervise(home, "running-1", supervisor)
    table = _cli(home, "fresh", "running-1")  # a unique prefix is enough; named jobs: any age
    assert table.returncode == 0, table.stderr
    assert "fresh-1234  local  run dir" in table.stdout and "freed " in table.stdout, table.stdout
    assert "left alone: running-1: not finished (RUNNING)" in table.stdout
    assert not fresh.exists() and running.is_dir()
    assert JobStore(home / "jobs.db").get("fresh-1234") is None
    for args, words in ((("--older-than", "soon"), "--older-than: not an age"), (("nosuchjob",), "nosuchjob: no such")):
        p = _cli(home, *args)
        assert p.returncode == 2 and words in p.stderr, p.stderr


def test_a_record_naming_a_dir_that_is_not_its_run_dir_never_has_it_removed(tmp_path):
    home = tmp_path / "home"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("x")
    store = JobStore(home / "jobs.db")
    store.create(job_id="odd", recipe="r", recipe_digest="d", cluster="local", backend="local", nodes=1, world_size=1,
                 run_dir=str(precious))
    store.update("odd", "COMPLETED")
    p = _cli(home, "odd", "--json")
    assert p.returncode == 0 and (precious / "keep.txt").is_file(), p.stdout
    assert json.loads(p.stdout)["items"] == [] and store.get("odd") is None  # the record goes, the dir stays


def test_a_job_recorded_running_whose_supervisor_died_long_ago_is_asked_and_removed(tmp_path):
    """A record left RUNNING by a supervisor that died 2 days ago: its backend is asked (nothing of it runs), the end
    is recorded, and its age is that of its last news, not of this gc."""
    home = tmp_path / "home"
    golden = Path(__file__).resolve().parents[1] / "golden" / "local_multi_gpu_cpu"
    plan = json.loads((golden / "plan.json").read_text())
    run = _job(home, "stale", "RUNNING", 2 * DAY)
    (run / "plan.json").write_text(json.dumps(dict(plan, job_id="stale", run_dir=str(run))))
    p = _cli(home, "--older-than", "1d", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["jobs"] == ["stale"] and not run.exists(), p.stdout


def test_an_ssh_job_whose_host_cannot_be_reached_keeps_its_record_unless_local_only(tmp_path):
    home = tmp_path / "home"
    key, known = tmp_path / "id_ed25519", tmp_path / "known_hosts"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    known.write_text("")
    run = _job(home, "far", "COMPLETED", 2 * DAY, backend="ssh")
    (run / "cluster.json").write_text(json.dumps({"kind": "ssh", "name": "lab", "ssh": {
        "hosts": ["127.0.0.1"], "port": 1, "key": str(key), "known_hosts": str(known), "connect_timeout": 2}}))
    (run / "handle.json").write_text(json.dumps({"uri": "ssh://far", "data": {"nodes": [
        {"rank": 0, "host": "127.0.0.1", "run_dir": "/var/tmp/w/runs/far"}]}}))
    p = _cli(home, "--older-than", "1d", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["jobs"] == [] and out["items"] == [] and "127.0.0.1: " in out["kept"]["far"], out
    assert "run gc again" in out["kept"]["far"] and run.is_dir()
    p = _cli(home, "--older-than", "1d", "--local-only", "--json")
    assert json.loads(p.stdout)["jobs"] == ["far"] and not run.exists(), p.stdout


def test_a_sweep_goes_with_its_last_point_and_not_before(tmp_path, supervisor):
    """A sweep's record, runner log, plot and SLURM array folder go once none of its points is left (and its runner
    is gone); while a point is kept, or its runner runs, they stay. --dry-run lists the same and removes nothing."""
    home = tmp_path / "home"
    sid, live = "sweep-20261128-010101-abcd", "sweep-20261128-020202-beef"
    _job(home, f"{sid}-p0", "COMPLETED", 2 * DAY)
    _job(home, f"{sid}-p1", "FAILED", 2 * DAY)
    _job(home, f"{live}-p0", "COMPLETED", 2 * DAY)
    sweeps, array = home / "sweeps", tmp_path / "slurm-work" / "sweeps" / sid
    sweeps.mkdir()
    array.mkdir(parents=True)
    (array / "job.sbatch").write_text("#!/bin/bash\n")
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "submit"])  # looks like one
    time.sleep(0.05)
    for s, pid in ((sid, 1), (live, runner.pid)):
        doc = {"id": s, "created": time.time() + 1, "runner_pid": pid, "sbatch": str(array / "job.sbatch") if s == sid
               else None, "points": [{"index": i, "job_id": f"{s}-p{i}"} for i in range(2)]}
        (sweeps / f"{s}.json").write_text(json.dumps(doc))
    (sweeps / f"{sid}.log").write_text("[p0] ...\n")
    (sweeps / f"{sid}.png").write_bytes(b"\x89PNG")
    try:
        kept = json.loads(_cli(home, "--older-than", "1d", "--keep-failed", "--json").stdout)
        assert sorted(kept["jobs"]) == sorted([f"{sid}-p0", f"{live}-p0"]), kept
        assert kept["kept"][f"{sid}-p1"].startswith("FAILED"), kept
        assert (sweeps / f"{sid}.json").is_file() and (sweeps / f"{sid}.log").is_file()  # p1 is still there
        assert (sweeps / f"{live}.json").is_file()  # no point left, but its runner runs (it may start p1 yet)
    finally:
        runner.kill()
        runner.wait()
    gone = json.loads(_cli(home, "--older-than", "1d", "--keep-failed", "--json").stdout)
    assert [(i["job"], i["what"]) for i in gone["items"]] == [(live, "sweep record")], gone
    assert not (sweeps / f"{live}.json").exists()

    dry = json.loads(_cli(home, "--older-than", "1d", "--dry-run", "--json").stdout)
    swept = {(i["job"], i["what"], i["path"]) for i in dry["items"] if i["job"] == sid}
    assert swept == {(sid, "sweep record", str(sweeps / f"{sid}.json")), (sid, "sweep log", str(sweeps / f"{sid}.log")),
                     (sid, "sweep plot", str(sweeps / f"{sid}.png")), (sid, "sweep folder", str(array))}, dry
    assert (sweeps / f"{sid}.json").is_file() and array.is_dir()
    real = json.loads(_cli(home, "--older-than", "1d", "--json").stdout)
    assert {(i["job"], i["what"], i["path"]) for i in real["items"] if i["job"] == sid} == swept
    assert not (sweeps / f"{sid}.json").exists() and not array.exists() and not (sweeps / f"{sid}.log").exists()


def test_a_job_file_the_api_wrote_goes_with_the_last_job_that_names_it(tmp_path):
    """orchestrator.submit({...}) writes the mapping to ORCHESTRATE_HOME/jobs/<digest>/<name>.yaml (client.job_file):
    gc removes that folder with the last job naming it, never while a kept job still does."""
    home = tmp_path / "home"
    files = {}
    for digest in ("aaaa", "bbbb"):
        files[digest] = home / "jobs" / digest / "job.yaml"
        files[digest].parent.mkdir(parents=True)
        files[digest].write_text("recipe: sft\n")
    store = JobStore(home / "jobs.db")
    for job, digest, age in (("old-a", "aaaa", 2 * DAY), ("old-b", "bbbb", 2 * DAY), ("new-b", "bbbb", 60)):
        _job(home, job, "COMPLETED", age)
        with sqlite3.connect(home / "jobs.db") as c:
            c.execute("UPDATE jobs SET recipe=? WHERE id=?", (str(files[digest]), job))
    assert store.get("old-a").recipe == str(files["aaaa"])
    r = _cli(home, "--older-than", "1d", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert sorted(out["jobs"]) == ["old-a", "old-b"], out
    assert ("old-a", "job file", str(files["aaaa"].parent)) in {(i["job"], i["what"], i["path"]) for i in out["items"]}
    assert not files["aaaa"].parent.exists() and files["bbbb"].is_file()  # (new-b still names bbbb's)
    r = _cli(home, "--older-than", "0s", "--json")
    assert r.returncode == 0 and not files["bbbb"].parent.exists(), r.stdout

"""The job store on a full filesystem (ORCHESTRATE_HOME on a 512 KiB tmpfs, filled up): writes fail with one clear
StoreFullError line naming the database and "no space left on device", nothing half-written; reads (`ls`,
`status`) keep working; an update that failed for lack of space succeeds when retried once there is room, and a
final state is recorded once.

Mounting a tmpfs needs root: without it these tests skip with that reason, except under CI=true (which runs as
root), where that is a failure: the suite must not silently shrink."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from helpers import cli, fill, small_tmpfs
from orchestrator.errors import OrchestratorError
from orchestrator.store import JobStore, StoreError, StoreFullError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_fs(tmp_path):
    """A 512 KiB tmpfs mounted at tmp_path/fs (unmounted at the end, pass or fail)."""
    yield from small_tmpfs(tmp_path / "fs", "512k")


def _job(store: JobStore, job_id: str) -> None:
    store.create(job_id=job_id, recipe="r.yaml", recipe_digest="d", cluster="local", backend="local", nodes=1,
                 world_size=1, run_dir=f"/nonexistent/runs/{job_id}")


def _assert_clear(e: StoreError, db: Path) -> None:
    msg = e.one_line()
    assert isinstance(e, OrchestratorError) and isinstance(e, StoreFullError)
    assert str(db) in msg and "no space left on device" in msg, msg
    assert "\n" not in str(e)


def test_writes_fail_clearly_reads_work_and_a_retry_records_the_final_state(small_fs, monkeypatch):
    home = small_fs / "home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    db = home / "jobs.db"
    store = JobStore()
    _job(store, "job-a")
    store.update("job-a", "RUNNING")
    filler = fill(small_fs)

    store = JobStore()  # opening works: the database file alone is read
    assert [(r.id, r.state) for r in store.list()] == [("job-a", "RUNNING")]
    assert store.get("job-a").state == "RUNNING" and store.get("job-") is not None
    with pytest.raises(StoreFullError) as e:
        _job(store, "job-b")
    _assert_clear(e.value, db)
    with pytest.raises(StoreFullError) as e:
        store.update("job-a", "FAILED", detail="rank 1 died", exit_code=1, final=True)
    _assert_clear(e.value, db)
    assert store.get("job-a").state == "RUNNING" and store.get("job-b") is None  # nothing half-written

    t0 = time.monotonic()
    threading.Timer(1.0, filler.unlink).start()  # room again in a second: the retry loop gets through
    assert store.update("job-a", "FAILED", detail="rank 1 died", exit_code=1, final=True, retry_s=15) is True
    assert 0.9 < time.monotonic() - t0 < 10
    rec = store.get("job-a")
    assert (rec.state, rec.exit_code) == ("FAILED", 1)
    assert [e["state"] for e in store.events("job-a")] == ["PENDING", "RUNNING", "FAILED"]
    # a reconciling reader (or a second retry) cannot record another final state
    assert store.update("job-a", "COMPLETED", final=True) is False
    assert store.get("job-a").state == "FAILED" and len(store.events("job-a")) == 3
    assert store.update("no-such-job", "FAILED") is False
    _job(store, "job-b")
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_fresh_home_on_a_full_disk_is_one_clear_error(small_fs, monkeypatch):
    fill(small_fs)
    monkeypatch.setenv("ORCHESTRATE_HOME", str(small_fs / "home"))
    with pytest.raises(StoreError) as e:
        JobStore()
    assert isinstance(e.value, StoreFullError) and "no space left on device" in e.value.one_line()
    assert str(small_fs / "home") in e.value.one_line()


def test_cli_ls_and_status_read_a_full_disk_and_writes_are_one_line(small_fs):
    home = small_fs / "home"
    env = {"ORCHESTRATE_HOME": str(home)}
    store = JobStore(home / "jobs.db")
    _job(store, "job-a")
    store.update("job-a", "FAILED", exit_code=1, root_cause="node 0 (localhost) failed: exit 1")
    fill(small_fs)
    ls = cli("ls", "--json", env=env)
    assert ls.returncode == 0 and '"job-a"' in ls.stdout, ls.stderr
    st = cli("status", "job-a", "--json", env=env)
    assert st.returncode == 0 and '"FAILED"' in st.stdout, st.stderr
    fresh = cli("ls", env={"ORCHESTRATE_HOME": str(small_fs / "other")})
    assert fresh.returncode != 0 and "Traceback" not in fresh.stderr, fresh.stderr
    lines = fresh.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orchestrate: error: "), fresh.stderr
    assert "no space left on device" in lines[0] and str(small_fs / "other") in lines[0]


def test_cli_submit_on_a_full_disk_is_one_line(small_fs):
    home = small_fs / "home"
    JobStore(home / "jobs.db")
    fill(small_fs)
    r = cli("submit", REPO / "recipes/configs/sft_tiny.yaml", "trainer.max_steps=1",
            env={"ORCHESTRATE_HOME": str(home)}, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]  # refused, as bad input is
    assert len(lines) == 1 and lines[0].startswith("orchestrate: error: ") and "no space left on device" in lines[0], \
        r.stderr[-3000:]
    left = [str(p) for d in ("runs", "supervisors") for p in (home / d).iterdir()] if (home / "runs").is_dir() else []
    assert not left, f"a refused submit left {left}"  # no half-written run dir, no pid file


def test_cli_submit_refused_while_writing_its_run_dir_leaves_nothing(small_fs):
    """Room for the store and the supervisor's pid file but not for the run dir's files: the run dir already begun
    is removed again, the refusal is one line, exit 2, and the store has no record of a job that never was."""
    home = small_fs / "home"
    JobStore(home / "jobs.db")
    filler = fill(small_fs)
    os.truncate(filler, max(0, filler.stat().st_size - 6 * 4096))  # a few pages: a pid file, not a run dir's files
    r = cli("submit", REPO / "recipes/configs/sft_tiny.yaml", "trainer.max_steps=1",
            env={"ORCHESTRATE_HOME": str(home)}, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("orchestrate: error: "), r.stderr[-3000:]
    assert not list((home / "runs").iterdir()) and not list((home / "supervisors").iterdir())
    assert JobStore(home / "jobs.db").list() == []


def test_node_log_on_a_full_disk_keeps_streaming(small_fs):
    """The local backend's node log writer (launchers/local.py): when its file cannot be written (no space), every
    line still reaches the supervisor (and the terminal), the problem is said once, and writing resumes with space."""
    from launchers.local import _LogFile
    said: list[str] = []
    log = _LogFile(small_fs / "node0.log", said.append)
    filler = fill(small_fs)
    for i in range(200):
        log.write(f"line {i} " + "x" * 200)
    assert len(said) == 1 and "no space left on device" in said[0], said
    filler.unlink()  # space is back
    log.write("after the disk was freed")
    log.close()
    assert "after the disk was freed" in (small_fs / "node0.log").read_text()

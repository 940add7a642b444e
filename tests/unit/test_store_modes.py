"""Everything the store creates under ORCHESTRATE_HOME is owner-only, whatever the umask: the home and its runs/,
cache/, supervisors/ directories 0700, jobs.db and its -wal / -shm files 0600; directories someone else's umask
left open (e.g. made as parents by a plain mkdir) are tightened; a shared directory is never touched."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from helpers import cli
from orchestrator.store import HOME_DIRS, JobStore, private_dir, write_private


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(params=[0o000, 0o022], ids=["umask000", "umask022"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_home_dirs_and_database_files_are_owner_only(tmp_path, monkeypatch, umask):
    home = tmp_path / "a" / "home"  # missing parents are created owner-only too
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    store = JobStore()
    store.create(job_id="j1", recipe="r.yaml", recipe_digest="d", cluster="local", backend="local", nodes=1,
                 world_size=1, run_dir=str(home / "runs" / "j1"))
    db = home / "jobs.db"
    reader = sqlite3.connect(db)  # keeps -wal and -shm in place while the store writes
    try:
        reader.execute("SELECT count(*) FROM jobs").fetchone()
        store.update("j1", "RUNNING")
        assert {p.name: mode(p) for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"))} == \
            {"jobs.db": 0o600, "jobs.db-wal": 0o600, "jobs.db-shm": 0o600}
    finally:
        reader.close()
    assert {p.name: mode(p) for p in (tmp_path / "a", home, *(home / d for d in HOME_DIRS))} == \
        {"a": 0o700, "home": 0o700, "runs": 0o700, "cache": 0o700, "supervisors": 0o700}
    assert mode(write_private(home / "supervisors" / "j1.pid", "123")) == 0o600
    assert (home / "supervisors" / "j1.pid").read_text() == "123"
    assert mode(private_dir(home / "runs" / "j1" / "nodes" / "0")) == 0o700 and mode(home / "runs" / "j1") == 0o700


def test_open_directories_and_files_are_tightened(tmp_path, monkeypatch):
    home = tmp_path / "home"
    old = os.umask(0o022)
    try:  # what `mkdir(parents=True)` under a 022 umask leaves (e.g. the trainer-fields cache written first)
        (home / "cache").mkdir(parents=True)
        (home / "runs").mkdir()
        (home / "jobs.db").touch()
    finally:
        os.umask(old)
    assert mode(home) == 0o755 and mode(home / "jobs.db") == 0o644
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    JobStore().list()
    assert [mode(p) for p in (home, home / "cache", home / "runs", home / "supervisors")] == [0o700] * 4
    assert mode(home / "jobs.db") == 0o600


def test_a_shared_directory_is_never_tightened(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: someone's ORCHESTRATE_HOME=/tmp must not lock everyone else out
    monkeypatch.setenv("ORCHESTRATE_HOME", str(shared))
    JobStore().list()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert mode(shared / "runs") == 0o700 and mode(shared / "jobs.db") == 0o600


def test_cli_on_a_fresh_home_under_umask_000(tmp_path):
    home = tmp_path / "fresh" / "home"
    r = cli("ls", env={"ORCHESTRATE_HOME": str(home)}, umask=0)
    assert r.returncode == 0, r.stderr
    assert [mode(p) for p in (tmp_path / "fresh", home, *(home / d for d in HOME_DIRS))] == [0o700] * 5
    assert mode(home / "jobs.db") == 0o600

"""The job store: one sqlite3 database (WAL) on the submit host, under ORCHESTRATE_HOME.

Owns job records (id, recipe digest, cluster, backend handle, nodes, state, state history with times,
restarts, exit code, root cause, run dir). Safe for concurrent `orchestrate` processes: every write is
one short transaction with a busy timeout. Never holds secrets (plans and recipes carry none).
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, created REAL NOT NULL, recipe TEXT NOT NULL, recipe_digest TEXT NOT NULL,
  cluster TEXT NOT NULL, backend TEXT NOT NULL, handle TEXT, nodes INTEGER NOT NULL, world_size INTEGER NOT NULL,
  state TEXT NOT NULL, updated REAL NOT NULL, exit_code INTEGER, root_cause TEXT, restarts INTEGER DEFAULT 0,
  run_dir TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, t REAL NOT NULL, state TEXT NOT NULL, detail TEXT);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, t);
"""


def home() -> Path:
    return Path(os.environ.get("ORCHESTRATE_HOME", "~/.orchestrate")).expanduser()


@dataclass(frozen=True)
class JobRecord:
    id: str
    created: float
    recipe: str
    recipe_digest: str
    cluster: str
    backend: str
    handle: str | None
    nodes: int
    world_size: int
    state: str
    updated: float
    exit_code: int | None
    root_cause: str | None
    restarts: int
    run_dir: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class JobStore:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else home() / "jobs.db"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._conn() as c:
            c.executescript(SCHEMA)

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            yield conn
        finally:
            conn.close()

    def create(self, *, job_id: str, recipe: str, recipe_digest: str, cluster: str, backend: str, nodes: int,
               world_size: int, run_dir: str, state: str = "PENDING") -> None:
        now = time.time()
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")
            c.execute("INSERT INTO jobs (id, created, recipe, recipe_digest, cluster, backend, nodes, world_size, "
                      "state, updated, run_dir) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                      (job_id, now, recipe, recipe_digest, cluster, backend, nodes, world_size, state, now, run_dir))
            c.execute("INSERT INTO events VALUES (?,?,?,?)", (job_id, now, state, None))
            c.execute("COMMIT")
        try:
            os.chmod(self.path, 0o600)
        except OSError:
            pass

    def update(self, job_id: str, state: str | None = None, detail: str | None = None, **fields) -> None:
        allowed = {"handle", "exit_code", "root_cause", "restarts"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {bad}")
        now = time.time()
        sets, vals = ["updated=?"], [now]
        if state:
            sets.append("state=?")
            vals.append(state)
        for k, v in fields.items():
            sets.append(f"{k}=?")
            vals.append(v)
        with self._conn() as c:
            c.execute("BEGIN IMMEDIATE")
            c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id=?", (*vals, job_id))
            if state or detail:
                c.execute("INSERT INTO events VALUES (?,?,?,?)", (job_id, now, state or "", detail))
            c.execute("COMMIT")

    def get(self, job_id: str) -> JobRecord | None:
        with self._conn() as c:
            row = c.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                rows = c.execute("SELECT * FROM jobs WHERE id LIKE ? ORDER BY created DESC", (job_id + "%",)).fetchall()
                row = rows[0] if len(rows) == 1 else None
        return JobRecord(*row) if row else None

    def list(self, limit: int = 20) -> list[JobRecord]:
        with self._conn() as c:
            rows = c.execute("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [JobRecord(*r) for r in rows]

    def events(self, job_id: str) -> list[dict]:
        with self._conn() as c:
            rows = c.execute("SELECT t, state, detail FROM events WHERE job_id=? ORDER BY t", (job_id,)).fetchall()
        return [{"t": t, "state": s, "detail": d} for t, s, d in rows]


def digest(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:16]

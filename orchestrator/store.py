"""The job store: one sqlite3 database (WAL) on the submit host, under ORCHESTRATE_HOME.

Owns job records (id, recipe digest, cluster, backend handle, nodes, state, state history with times,
restarts, exit code, root cause, run dir). Safe for concurrent `orchestrate` processes: every write is
one short transaction with a busy timeout. Never holds secrets (plans and recipes carry none).

Owner-only: ORCHESTRATE_HOME and its runs/, cache/, supervisors/ are 0700 (`private_dir` creates them with the
mode and chmods them, whatever the umask), jobs.db is created 0600 before sqlite opens it, so its -wal and -shm
files (sqlite gives them the database's mode) are 0600 too.

Failures are `StoreError`s (an `OrchestratorError`: the CLI prints one line) naming the database; a full disk is
`StoreFullError` ("... no space left on device"). A write either commits whole or not at all, so a caller whose
`update` failed for lack of space can simply call it again later (`retry_s` does that in a loop); `final=True`
records a terminal state only if the job has none yet, so a late retry and a reconciling `ls` cannot disagree.
Reads keep working on a full disk: when sqlite cannot set up its WAL index there (it needs space for -shm) and
the write-ahead log holds nothing, the database file alone is read (immutable).
"""

from __future__ import annotations

import builtins
import errno
import os
import sqlite3
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from orchestrator.errors import OrchestratorError

from orchestrator.types import TERMINAL as _TERMINAL

TERMINAL = tuple(s.value for s in _TERMINAL)  # the one terminal set (orchestrator.types)
HOME_DIRS = ("runs", "cache", "supervisors")  # created owner-only with the home by every JobStore on it

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

# Below this many free bytes an sqlite I/O error is taken for a full disk (sqlite needs 32 KiB for its WAL index
# alone, and a page or more per write).
LOW_SPACE_BYTES = 1 << 20
SQLITE_BUSY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN = 5, 10, 13, 14  # primary result codes (sqlite3.h)


class StoreError(OrchestratorError):
    """The job store could not be read or written (one line: the database path and why)."""

    def __init__(self, message: str, path: Path | str | None = None):
        self.path = str(path) if path is not None else None
        super().__init__(message)


class StoreFullError(StoreError):
    """The filesystem under ORCHESTRATE_HOME is full (or out of inodes / over quota). Nothing was written:
    the same call can be retried once there is space."""


def home() -> Path:
    return Path(os.environ.get("ORCHESTRATE_HOME", "~/.orchestrate")).expanduser()


def sweeps_dir() -> Path:
    """ORCHESTRATE_HOME/sweeps: a sweep's record <id>.json, a detached runner's output <id>.log, its plot <id>.png,
    its points' loss summary <id>.losses.json (orchestrator.sweeps writes them, orchestrator.gc removes them with the
    sweep's last point)."""
    return home() / "sweeps"


def _no_space(path: Path) -> bool:
    """True when the filesystem holding `path` (or its nearest existing parent) has (almost) no room left."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return False
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    inodes = st.f_ffree if os.geteuid() == 0 else st.f_favail
    return blocks * st.f_frsize < LOW_SPACE_BYTES or (st.f_files > 0 and inodes == 0)


def _os_error(e: OSError, path: Path, what: str) -> StoreError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on device" if e.errno == errno.ENOSPC else \
            "disk quota exceeded (no space left on device)"
        return StoreFullError(f"{what} {path}: {reason}; free some space or set ORCHESTRATE_HOME to another "
                              "filesystem", path)
    return StoreError(f"{what} {path}: {e.strerror or e}", path)


def private_dir(path: Path | str, *, tighten: bool = False) -> Path:
    """Create `path` (and any missing parent) owner-only: mkdir with mode 0700, then chmod (the umask may have
    taken bits off). `tighten`: an existing directory of ours with group/other bits is chmod 0700 too (never a
    shared one: sticky or world-writable like /tmp, nor the user's home directory). Raises StoreError
    (StoreFullError on a full disk)."""
    path = Path(path)
    missing = []
    p = path
    while not p.is_dir() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                if not d.is_dir():
                    raise
            os.chmod(d, 0o700)
        if tighten and not missing:
            st = path.stat()
            shared = st.st_mode & (stat.S_ISVTX | stat.S_IWOTH) or path.resolve() == Path.home().resolve()
            if st.st_mode & 0o077 and st.st_uid == os.geteuid() and not shared:
                os.chmod(path, 0o700)
    except OSError as e:
        raise _os_error(e, path, "cannot create directory") from None
    return path


def write_private(path: Path | str, data: str | bytes) -> Path:
    """Write a file owner-only (0600: created with the mode, then chmod) in an owner-only directory, atomically
    (a temporary file renamed over it). On a full disk raises StoreFullError naming the path and leaves neither a
    partial file nor the temporary one."""
    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise _os_error(e, path, "cannot write") from None
    return path


def ensure_home() -> Path:
    """ORCHESTRATE_HOME and its runs/, cache/, supervisors/ directories, all 0700."""
    h = private_dir(home(), tighten=True)
    for name in HOME_DIRS:
        private_dir(h / name, tighten=True)
    return h


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
    """create / update / get / list / events / delete over jobs.db. Every method raises StoreError (StoreFullError
    when the disk is full) rather than sqlite3 errors."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path else home() / "jobs.db"
        if path is None or self.path.parent == home():
            ensure_home()
        else:
            private_dir(self.path.parent)
        self._private_files()
        try:
            with self._conn() as c:
                c.executescript(SCHEMA)
        except StoreFullError:
            if not self._readable_without_wal():  # a full disk: reads can still go to the database file alone
                raise

    # ------------------------------------------------------------------------------------------- plumbing

    def _private_files(self) -> None:
        """jobs.db exists 0600 before sqlite opens it (sqlite gives -wal/-shm the database's mode)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
        except OSError as e:
            raise _os_error(e, self.path, "job store") from None
        for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            try:
                if p.stat().st_mode & 0o077:
                    os.chmod(p, 0o600)
            except OSError:
                pass

    def _error(self, e: sqlite3.Error) -> StoreError:
        name = getattr(e, "sqlite_errorname", "") or type(e).__name__
        code = getattr(e, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        if primary == SQLITE_BUSY or (primary is None and "locked" in str(e)):
            return StoreError(f"job store {self.path}: busy (locked by another orchestrate process for over 30 s)",
                              self.path)
        if primary == SQLITE_FULL or (primary in (SQLITE_IOERR, SQLITE_CANTOPEN, None)
                                      and isinstance(e, sqlite3.OperationalError) and _no_space(self.path)):
            return StoreFullError(f"job store {self.path}: no space left on device ({e}; {name}); free some space "
                                  "or set ORCHESTRATE_HOME to another filesystem", self.path)
        return StoreError(f"job store {self.path}: {e} ({name})", self.path)

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        try:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        except sqlite3.Error as e:
            raise self._error(e) from None
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            yield conn
        except sqlite3.Error as e:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise self._error(e) from None
        finally:
            conn.close()

    def _readable_without_wal(self) -> bool:
        """True when the database file alone holds every committed write (no write-ahead log left over, or an
        empty one) and has the schema: then it can be read immutable, without sqlite's -shm index."""
        wal = Path(f"{self.path}-wal")
        try:
            if wal.exists() and wal.stat().st_size > 0:
                return False
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?immutable=1", uri=True)
        except (OSError, sqlite3.Error):
            return False
        try:
            return conn.execute("SELECT 1 FROM sqlite_master WHERE name='jobs'").fetchone() is not None
        except sqlite3.Error:
            return False
        finally:
            conn.close()

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            with self._conn() as c:
                return c.execute(sql, args).fetchall()
        except StoreFullError:
            if not self._readable_without_wal():
                raise
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?immutable=1", uri=True)
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise self._error(e) from None
        finally:
            conn.close()

    def _write(self, statements: list[tuple[str, tuple]], retry_s: float = 0.0, guard: tuple[str, tuple] | None = None
               ) -> bool:
        """Run the statements in one IMMEDIATE transaction (all or nothing). `guard`: a query whose first column
        must be truthy for the write to happen (checked inside the transaction); returns whether it happened.
        A StoreFullError is retried every second for up to `retry_s` seconds."""
        deadline = time.monotonic() + max(0.0, retry_s)
        while True:
            try:
                with self._conn() as c:
                    c.execute("BEGIN IMMEDIATE")
                    if guard is not None:
                        row = c.execute(*guard).fetchone()
                        if not row or not row[0]:
                            c.execute("ROLLBACK")
                            return False
                    for sql, args in statements:
                        c.execute(sql, args)
                    c.execute("COMMIT")
                    return True
            except StoreFullError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    # ------------------------------------------------------------------------------------------- API

    def create(self, *, job_id: str, recipe: str, recipe_digest: str, cluster: str, backend: str, nodes: int,
               world_size: int, run_dir: str, state: str = "PENDING") -> None:
        now = time.time()
        try:
            self._write([("INSERT INTO jobs (id, created, recipe, recipe_digest, cluster, backend, nodes, world_size, "
                          "state, updated, run_dir) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                          (job_id, now, recipe, recipe_digest, cluster, backend, nodes, world_size, state, now,
                           run_dir)),
                         ("INSERT INTO events VALUES (?,?,?,?)", (job_id, now, state, None))])
        except StoreError as e:
            if "UNIQUE constraint" in str(e):
                raise StoreError(f"job store {self.path}: job {job_id} already exists", self.path) from None
            raise
        self._private_files()

    def update(self, job_id: str, state: str | None = None, detail: str | None = None, *, final: bool = False,
               retry_s: float = 0.0, **fields: Any) -> bool:
        """Set the state and/or fields (handle, exit_code, root_cause, restarts) of a job and log an event.
        One transaction: on StoreFullError nothing was written and the same call can be made again later.
        `final=True`: only if the job is not in a terminal state yet (a supervisor's late retry and a reconciling
        reader record one final state, whichever comes first). `retry_s`: keep retrying a full disk for that long.
        Returns True when the job was updated (False: no such job, or `final` and already terminal)."""
        allowed = {"handle", "exit_code", "root_cause", "restarts"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {bad}")
        now = time.time()
        sets: list[str] = ["updated=?"]
        vals: list[Any] = [now]
        if state:
            sets.append("state=?")
            vals.append(state)
        for k, v in fields.items():
            sets.append(f"{k}=?")
            vals.append(v)
        stmts = [(f"UPDATE jobs SET {', '.join(sets)} WHERE id=?", (*vals, job_id))]
        if state or detail:
            stmts.append(("INSERT INTO events VALUES (?,?,?,?)", (job_id, now, state or "", detail)))
        guard: tuple[str, tuple[Any, ...]]
        if final:
            guard = (f"SELECT COUNT(*) FROM jobs WHERE id=? AND state NOT IN ({','.join('?' * len(TERMINAL))})",
                     (job_id, *TERMINAL))
        else:
            guard = ("SELECT COUNT(*) FROM jobs WHERE id=?", (job_id,))
        done = self._write(stmts, retry_s=retry_s, guard=guard)
        if done and (state in TERMINAL or state == "RUNNING"):
            self.moved()
        return done

    @property
    def wake_path(self) -> Path:
        """jobs.wake: its mtime moves whenever a job of this store ends or starts running (the queue's wake-up,
        `wait_moved`)."""
        return self.path.with_suffix(".wake")

    def moved(self) -> None:
        """Tell the jobs queued in this store that one ended (their hosts or GPUs may be free now) or left the
        queue (their place moved up)."""
        try:
            with open(self.wake_path, "a"):
                pass
            os.utime(self.wake_path)
        except OSError:
            pass  # a full disk: the waiters still look every QUEUE_POLL_S

    def wake_stamp(self) -> int:
        """Where the queue's wake-up stands now (jobs.wake's mtime; 0 before any): `wait_moved(since=...)`."""
        try:
            return os.stat(self.wake_path).st_mtime_ns
        except OSError:
            return 0

    def wait_moved(self, timeout: float, cancelled: Callable[[float], bool], every: float = 0.05,
                   since: int | None = None) -> bool:
        """Wait up to `timeout` seconds for a job of this store to end or start (True), or `cancelled(wait_s)` to say
        True (False); a stat every `every` seconds, nothing else. `since`: a wake_stamp() taken earlier: a move since
        then counts (at once), so one that came while the caller was busy (a try that found the hosts leased) is not
        missed."""
        seen, deadline = self.wake_stamp() if since is None else since, time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.wake_stamp() != seen:
                return True
            if cancelled(every):
                return False
        return False

    def get(self, job_id: str) -> JobRecord | None:
        rows = self._read("SELECT * FROM jobs WHERE id=?", (job_id,))
        if not rows:
            rows = self._read("SELECT * FROM jobs WHERE id LIKE ? ORDER BY created DESC", (job_id + "%",))
            if len(rows) != 1:
                return None
        return JobRecord(*rows[0])

    def list(self, limit: int | None = 20) -> list[JobRecord]:
        """The latest `limit` jobs, newest first (None: every job)."""
        rows = self._read("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (-1 if limit is None else limit,))
        return [JobRecord(*r) for r in rows]

    def delete(self, job_id: str) -> bool:
        """Remove a job's record and its events (`orchestrate gc`), one transaction; False when there is none.
        Only a job in a terminal state is removed (a record that is still live is never dropped)."""
        terminal = f"SELECT COUNT(*) FROM jobs WHERE id=? AND state IN ({','.join('?' * len(TERMINAL))})"
        return self._write([("DELETE FROM events WHERE job_id=?", (job_id,)),
                            ("DELETE FROM jobs WHERE id=?", (job_id,))], guard=(terminal, (job_id, *TERMINAL)))

    def events(self, job_id: str) -> builtins.list[dict]:  # `list` here is the method above
        rows = self._read("SELECT t, state, detail FROM events WHERE job_id=? ORDER BY t", (job_id,))
        return [{"t": t, "state": s, "detail": d} for t, s, d in rows]

    def events_of(self, job_ids: builtins.list[str]) -> dict[str, builtins.list[dict]]:
        """`events` of several jobs in one query (a page of a jobs list): job id -> its events, oldest first."""
        out: dict[str, builtins.list[dict]] = {j: [] for j in job_ids}
        if job_ids:
            rows = self._read(f"SELECT job_id, t, state, detail FROM events WHERE job_id IN "
                              f"({','.join('?' * len(job_ids))}) ORDER BY t", tuple(job_ids))
            for j, t, s, d in rows:
                out[j].append({"t": t, "state": s, "detail": d})
        return out


def digest(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:16]

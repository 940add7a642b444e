"""The one writer of heartbeat records (docs/CONTRACT.md), and a one-line heartbeat for any training loop.

Standard library only: it is importable in a rank before anything else (the zero-code hooks, `sitecustomize`),
from the built-in recipes (`recipes/callbacks.py`) and from a user's own script, which needs nothing but this
file on its path (the node agent puts this directory on the ranks' PYTHONPATH):

    try:
        import orchestrate_heartbeat              # on the path only when run by orchestrate
    except ImportError:
        orchestrate_heartbeat = None
    ...
    for step in range(1, n + 1):
        loss = train_one_step()
        if orchestrate_heartbeat:
            orchestrate_heartbeat.beat(step, loss=loss)   # a no-op unless ORCHESTRATE_HEARTBEAT_DIR is set

`beat` is for loops that step no torch optimizer (the hooks count optimizer steps by themselves) or that want
their own step numbers and losses in the records: once a script calls it, the optimizer-step hook stays silent
(no double counting).

Records: one JSON line per event appended to ORCHESTRATE_HEARTBEAT_DIR/rank<G>.jsonl (G = RANK), with exactly
the contract's fields {"t", "rank", "host", "step", "max_steps", "loss", "tokens", "event"} (+ named extras
such as "proc_start" on the "boot" mark, and "compute_s" on a step record when the hooks timed the rank's forward:
the straggler evidence, see `add_compute`, and "arrive": when the rank entered the latest collectives, see
`add_arrivals`). Each write is one os.write of whole lines on an O_APPEND descriptor;
files are created 0600. A write error never fails a run (one warning on stderr, then the writer goes quiet).

Throttling: "step" records written with `lazy=True` (the optimizer-step hook, `beat`) are buffered and written
together once `FLUSH_S` seconds have passed since the last write (checked at each record: the file lags by at
most FLUSH_S plus one step; ORCHESTRATE_HEARTBEAT_FLUSH_S, default 0.5; 0 writes every record at once). Every
other event, and the Trainer callbacks' records, are written at once. Buffers are flushed at exit (not when the
process is killed: a dying rank's last fraction of a second of steps is lost, which no health rule needs).

Who writes "step" records: a Trainer heartbeat callback (while it trains) > explicit `beat` calls > the
optimizer-step hook. `claim` / `release` / `claimed` implement that order across the writers of one process.

This module is importable under two names (`orchestrate_heartbeat` from the hooks directory,
`orchestrator.node.hooks.orchestrate_heartbeat` from the package); both names resolve to ONE module object per
process, so the claims and the default writer are shared.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

CONTRACT_FIELDS = ("t", "rank", "host", "step", "max_steps", "loss", "tokens", "event")
FLUSH_S = float(os.environ.get("ORCHESTRATE_HEARTBEAT_FLUSH_S") or 0.5)

_claims: set[str] = set()
_arrivals: list = []  # [collective number, seconds] not written yet (add_arrivals)
ARRIVALS_KEPT = 256
_compute = [0.0]  # seconds this rank spent in its model's own forward since the last step record (add_compute)
_default: "Writer | None" = None
_hook: "Writer | None" = None
_writers: "list[Writer]" = []  # every open writer of this process, flushed at exit


def env_rank() -> int:
    """The global rank of this process (RANK, else LOCAL_RANK, else 0)."""
    for name in ("RANK", "LOCAL_RANK"):
        v = os.environ.get(name)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                pass
    return 0


_LINE = ('{"t": %r, "rank": %d, "host": %s, "step": %d, "max_steps": %d, "loss": %s, "tokens": %s, '
         '"event": %s}\n')
_STEP_ENDS = ("step", "save_start")  # the records that end a training step (a Trainer saving writes save_start)
_EVENTS = {e: json.dumps(e) for e in ("step", "start", "save_start", "save", "end", "preempted", "boot", "dist")}


def add_compute(seconds: float) -> None:
    """Count `seconds` of this rank's own compute (its model's forward, timed by the hooks): the next step record
    carries the sum as "compute_s", the straggler evidence (orchestrator.core.health)."""
    _compute[0] += seconds


def add_arrivals(pairs: list) -> None:
    """[[collective number, seconds], ...]: when this rank entered the default group's collectives (its flight
    recorder, read by orchestrate_hangs' sampler thread): the next step record carries them as "arrive", the
    evidence of who enters each collective last (orchestrator.core.health)."""
    _arrivals.extend(pairs)  # (list.extend and the swap in write() are each atomic under the GIL)
    del _arrivals[:-ARRIVALS_KEPT]


def _take_compute() -> float | None:
    s = _compute[0]
    if s <= 0.0:
        return None
    _compute[0] = 0.0
    return round(s, 6)


def _number(x: float | None) -> str:
    if x is None:
        return "null"
    return repr(x) if x - x == 0.0 else json.dumps(x)  # NaN / Infinity as json.dumps writes them


class Writer:
    """Appends records to DIRECTORY/rank<R>.jsonl. Self-timed: `overhead_s` (time spent in `write`/`flush`),
    `records` (records written or buffered), `writes` (os.write calls). `hold_first`: the first lazy record waits
    FLUSH_S too (the optimizer-step hook's writer: a `beat` or a Trainer that starts right after it drops it)."""

    def __init__(self, directory: str | None, rank: int | None = None, hold_first: bool = False):
        self.hold_first = hold_first
        self.dir = directory or None
        self.rank = env_rank() if rank is None else int(rank)
        self.host: str | None = None
        self._host_json = "null"
        self.fd = -1
        self.pid = os.getpid()
        self.buf: list = []  # lines, or (t, step, max_steps, loss, tokens, event) of records not formatted yet
        self.last_flush = float("-inf")  # the first record goes out at once
        self.failed = False
        self.overhead_s = 0.0
        self.records = 0
        self.writes = 0
        _writers.append(self)

    @property
    def active(self) -> bool:
        return bool(self.dir) and not self.failed

    def write(self, event: str, step: int = 0, max_steps: int = 0, loss=None, tokens=None, lazy: bool = False,
              **extra) -> None:
        if not self.dir or self.failed:
            return
        t0 = time.perf_counter()
        if self.host is None:
            import socket

            self.host = socket.gethostname()
            self._host_json = json.dumps(self.host)
        if event in _STEP_ENDS:  # the forward time since the last step record goes with this one
            compute = _take_compute()
            if compute is not None:
                extra["compute_s"] = compute
            if _arrivals:
                extra["arrive"] = _arrivals[:]
                del _arrivals[:len(extra["arrive"])]
        if extra:
            rec = {"t": time.time(), "rank": self.rank, "host": self.host, "step": int(step),
                   "max_steps": int(max_steps or 0), "loss": None if loss is None else float(loss),
                   "tokens": None if tokens is None else int(tokens), "event": event, **extra}
            self.buf.append(json.dumps(rec) + "\n")
        else:  # formatted when written (a buffered step record costs a tuple until then)
            self.buf.append((time.time(), step, max_steps, None if loss is None else float(loss),
                             None if tokens is None else int(tokens), event))  # no tensor is kept alive
        self.records += 1
        now = time.monotonic()
        if lazy and self.hold_first:
            self.hold_first = False
            self.last_flush = now
        if not lazy or FLUSH_S <= 0 or now - self.last_flush >= FLUSH_S:
            self._flush(now)
        self.overhead_s += time.perf_counter() - t0

    def _line(self, item) -> str:
        if isinstance(item, str):
            return item
        t, step, max_steps, loss, tokens, event = item
        # the same text json.dumps gives for these fields, at a quarter of its cost (every step pays it)
        return _LINE % (t, self.rank, self._host_json, int(step), int(max_steps or 0), _number(loss),
                        "null" if tokens is None else tokens, _EVENTS.get(event) or json.dumps(event))

    def flush(self) -> None:
        if self.buf:
            t0 = time.perf_counter()
            self._flush(time.monotonic())
            self.overhead_s += time.perf_counter() - t0

    def _flush(self, now: float) -> None:
        self.last_flush = now
        if not self.buf:
            return
        items = self.buf
        self.buf = []
        if os.getpid() != self.pid:  # a forked child never writes its parent's records
            return
        try:
            data = "".join(map(self._line, items)).encode()
            if self.fd < 0:
                os.makedirs(self.dir, exist_ok=True)
                self.fd = os.open(os.path.join(self.dir, f"rank{self.rank}.jsonl"),
                                  os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
            self.writes += 1
        except OSError as e:
            self.failed = True
            print(f"orchestrate: heartbeats disabled in this process: {e}", file=sys.stderr, flush=True)

    def drop(self) -> None:
        """Forget the buffered records (another writer took the step records over)."""
        self.buf.clear()

    def close(self) -> None:
        self.flush()
        if self.fd >= 0 and os.getpid() == self.pid:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = -1
        if self in _writers:
            _writers.remove(self)


def default_writer() -> Writer:
    """The process's own writer (ORCHESTRATE_HEARTBEAT_DIR, RANK), used by `beat` and the start-up marks."""
    global _default
    if _default is None:
        _default = Writer(os.environ.get("ORCHESTRATE_HEARTBEAT_DIR"))
    return _default


def hook_writer() -> Writer:
    """The optimizer-step hook's writer: its records are dropped, not written, when a `claim` comes first."""
    global _hook
    if _hook is None:
        _hook = Writer(os.environ.get("ORCHESTRATE_HEARTBEAT_DIR"), hold_first=True)
    return _hook


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) starts with writers of its own and none of its parent's buffered lines."""
    global _default, _hook
    for w in _writers:
        w.buf.clear()
    _default = _hook = None


def claim(who: str) -> None:
    """`who` ("trainer", "beat") now writes this process's step records; the optimizer-step hook stays silent, and
    what it still holds is dropped (the claimant reports those steps itself)."""
    if _hook is not None:
        _hook.drop()
    _claims.add(who)


def release(who: str) -> None:
    _claims.discard(who)


def claimed() -> bool:
    return bool(_claims)


_beat_step = 0


def beat(step: int | None = None, loss=None, *, max_steps: int = 0, tokens=None, event: str = "step") -> None:
    """One heartbeat record: call it once per training step (step counts from 1; None = count the calls).
    A no-op unless ORCHESTRATE_HEARTBEAT_DIR is set (outside orchestrate). Events other than "step" follow
    docs/CONTRACT.md ("start", "save_start", "save", "end", "preempted")."""
    global _beat_step
    if not os.environ.get("ORCHESTRATE_HEARTBEAT_DIR"):
        return
    if step is None:
        step = _beat_step + (event == "step")
    _beat_step = int(step)
    if "beat" not in _claims:
        claim("beat")
    default_writer().write(event, step, max_steps, loss, tokens, lazy=event == "step")


def mark(event: str, **extra) -> None:
    """A start-up phase record (step 0: start-up progress, never a training step), e.g. "boot"."""
    if os.environ.get("ORCHESTRATE_HEARTBEAT_DIR"):
        default_writer().write(event, 0, **extra)


def flush_all() -> None:
    for w in list(_writers):
        try:
            w.flush()
        except Exception:  # noqa: BLE001 - at exit: a heartbeat never fails the process
            pass


def one_module_per_process(name: str, short: str) -> bool:
    """Make both import names of a hooks module (`short` from the hooks directory, orchestrator.node.hooks.`short`
    from the package) resolve to one module object: the first one loaded wins. True when `name` is that one."""
    full = "orchestrator.node.hooks." + short
    if name not in (short, full):
        return True  # run as a script, or copied under another name: nothing to share
    twin = full if name == short else short
    if twin in sys.modules:
        sys.modules[name] = sys.modules[twin]  # the import statement then returns the twin
        return False
    sys.modules[twin] = sys.modules[name]
    return True


if one_module_per_process(__name__, "orchestrate_heartbeat"):
    atexit.register(flush_all)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)

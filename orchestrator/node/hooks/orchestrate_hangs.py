"""The rank's hang responder: asked by its node agent on a hang, it writes the rank's evidence, even while the main
thread is blocked in a collective, in C code or busy in Python.

`start()` (from orchestrate_hooks.install, standard library only) makes the FIFO RUN_DIR/hangs/ask_rank<G> and a
daemon thread blocked in opening it (no GIL held, no CPU used). The node agent writes a byte to it
(orchestrator.node.hangevidence); the thread then writes RUN_DIR/hangs/rank<G>.json (atomic, 0600):
  {"rank", "pid", "host", "t", "fr": {"entries": [...], "pg_config": {...}} (torch's flight recorder, gloo and NCCL,
   the last ENTRIES collectives, no C++ stack traces), "fr_error", "stacks": [{"thread", "name", "main",
   "frames": [[file, line, function, source line], ...]}] (every Python thread, outermost frame first)}.
A gloo or NCCL collective, a lock, a sleep or file I/O release the GIL, so the thread runs at once; a main thread busy
in pure Python hands the GIL over every switch interval (5 ms). A stopped process (SIGSTOP) does not answer: the agent
names it from its process state and keeps its py-spy stacks.
A second daemon thread samples the recorder every ARRIVAL_S seconds: when this rank entered each collective of the
default group, carried on its next step record ("arrive"), the evidence that names a rank that is slow anywhere
in its step (orchestrator.core.health: who enters the collectives last, and by how much).
It also sizes the flight recorder where the user did not: torch keeps 2000 entries by default (on); BUFFER entries
are enough for a hang and keep each of the sampler's reads (the whole buffer, dumped and unpickled) to ~2.5 ms;
a GPU plan sets TORCH_NCCL_TRACE_BUFFER_SIZE (orchestrator.core.plan.NCCL_FORENSICS). ORCHESTRATE_HANG_EVIDENCE=0:
none of it (and torch's own default stands).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ARRIVAL_S = 2.0  # how often the arrival sampler reads the recorder (ORCHESTRATE_ARRIVAL_S; 0: never)
BUFFER = "256"  # flight-recorder entries kept per rank (a hang needs the last few; the dump stays a few ms)
ENTRIES = 64  # ... of which the evidence file keeps the last
DIR = "hangs"  # = orchestrator.node.rundir.RunDir.HANGS (this file imports nothing of orchestrator)
SAMPLING = threading.Event()  # cleared: the sampler skips its reads (bench/bench_hangs.py: its cost, blocks of a run)
SAMPLING.set()
STATS = {"reads": 0, "read_s": 0.0}  # the sampler's self-timed cost: reads done, seconds spent in them (wall)
_KEEP = ("collective_seq_id", "p2p_seq_id", "is_p2p", "profiling_name", "process_group", "pg_id", "state",
         "input_sizes", "output_sizes", "time_created_ns", "time_discovered_started_ns",
         "time_discovered_completed_ns")


def enabled() -> bool:
    return os.environ.get("ORCHESTRATE_HANG_EVIDENCE", "1").strip().lower() not in ("0", "false", "no", "off")


def start() -> None:
    """Size the flight recorder and start the responder (in a rank of an orchestrate launch; never fails it)."""
    env = os.environ
    if not enabled():
        return
    env.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER)
    run_dir, rank = env.get("ORCHESTRATE_RUN_DIR", ""), env.get("RANK", "")
    if not run_dir or not rank.isdigit():
        return
    d = os.path.join(run_dir, DIR)
    fifo = os.path.join(d, f"ask_rank{int(rank)}")
    try:
        os.makedirs(d, 0o700, exist_ok=True)
        try:
            os.unlink(fifo)  # (an earlier attempt's)
        except FileNotFoundError:
            pass
        os.mkfifo(fifo, 0o600)
    except OSError as e:
        print(f"orchestrate: no hang responder in rank {rank}: {e}", file=sys.stderr, flush=True)
        return
    threading.Thread(target=_serve, args=(fifo, d, int(rank)), name="orchestrate-hangs", daemon=True).start()
    every = float(env.get("ORCHESTRATE_ARRIVAL_S") or ARRIVAL_S)
    if every > 0:
        threading.Thread(target=_sample, args=(every,), name="orchestrate-arrivals", daemon=True).start()


def _sample(every: float) -> None:
    """Every `every` seconds, the default group's collectives this rank entered since the last look (number, time),
    handed to the heartbeat writer (orchestrate_heartbeat.add_arrivals): straggler evidence by arrival."""
    try:
        import orchestrate_heartbeat as hb
    except ImportError:
        from orchestrator.node.hooks import orchestrate_heartbeat as hb
    import pickle
    last = 0
    while True:
        time.sleep(every)
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is None or not SAMPLING.is_set() or not dist.is_initialized():
                continue
            import torch
            t0 = time.perf_counter()
            data = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
        except Exception:  # noqa: BLE001 - no recorder here (yet): evidence by forward time only
            continue
        new = []
        for e in data.get("entries") or ():
            seq, pg = e.get("collective_seq_id"), e.get("process_group")
            if e.get("is_p2p") or not isinstance(seq, int) or seq <= last or not pg or str(pg[0]) != "0":
                continue
            t = e.get("time_created_ns")
            if isinstance(t, int):
                new.append([seq, round(t / 1e9, 6)])
        if new:
            last = max(s for s, _ in new)
            hb.add_arrivals(new)
        STATS["reads"] += 1
        STATS["read_s"] += time.perf_counter() - t0


def _serve(fifo: str, d: str, rank: int) -> None:
    pid = os.getpid()
    while True:
        try:
            with open(fifo, "rb") as fh:  # blocks, without the GIL, until the agent opens it to write
                fh.read(64)
        except OSError:
            return
        if os.getpid() != pid:
            return  # (a forked child never answers for the rank)
        try:
            write_evidence(d, rank)
        except Exception as e:  # noqa: BLE001 - never break the rank
            print(f"orchestrate: hang evidence of rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _fr() -> tuple[dict, str]:
    """The flight recorder's last ENTRIES collectives and the process groups (gloo and NCCL), or an error text."""
    if "torch.distributed" not in sys.modules:
        return {}, "torch.distributed not imported"
    import pickle

    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    entries: list = []
    pg: dict = {}
    errors = []
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = pickle.loads(fn(includeStackTraces=False))
        except Exception as e:  # noqa: BLE001 - no recorder of this kind in this process
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        entries += [{k: e.get(k) for k in _KEEP} for e in (data.get("entries") or [])[-ENTRIES:]]
        cfg = data.get("pg_config")
        if isinstance(cfg, dict):
            pg.update({str(k): v for k, v in cfg.items()})
    return {"entries": entries, "pg_config": pg}, "; ".join(errors)


def _stacks() -> list[dict]:
    import linecache

    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = []
        f = frame
        while f is not None and len(frames) < 200:
            code = f.f_code
            frames.append([code.co_filename, f.f_lineno, code.co_name,
                           linecache.getline(code.co_filename, f.f_lineno).strip()[:200]])
            f = f.f_back
        out.append({"thread": ident, "name": names.get(ident, ""), "main": ident == main,
                    "frames": frames[::-1]})
    return out


def write_evidence(d: str, rank: int) -> str:
    t0 = time.time()
    stacks = _stacks()  # first: what the threads are doing when asked
    fr, err = _fr()
    rec = {"rank": rank, "pid": os.getpid(), "host": os.uname().nodename, "t": t0, "took_s": time.time() - t0,
           "fr": fr, "fr_error": err, "stacks": stacks}
    path = os.path.join(d, f"rank{rank}.json")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(rec, fh, default=str)
    os.replace(path + ".tmp", path)
    return path

#!/usr/bin/env python3
"""The one Supervisor at scale, by simulation of its event stream (issue #29; not CI; a small size runs in
tests/unit/test_supervisor_scale.py): N emulated nodes x R ranks, every rank heartbeating `--rate` times a second
(the records exactly as the hooks write them, with compute_s), fed to the real `orchestrator.supervise.Supervisor`
through a stand-in `Running` (orchestrator/events.py protocol) instead of a backend; after `--seconds`, node 1 fails
(a NodeEnded with a rank death, as an agent reports it). Measured per size, in this process:
- the supervising thread's CPU seconds (time.thread_time) per wall second over the heartbeat phase, and per 1,000
  heartbeats;
- the decision time: from the failure's event being handed to the supervisor to its teardown call (`stop` on the
  job: every other node told to stop);
- heartbeats delivered (to check the stand-in kept up).
The stand-in itself runs in its own thread (its CPU is not counted). `--progress` also feeds the CLI's progress
display (orchestrator.cli.progress.Progress, as `submit` does) from the supervisor's on_beat.

    .venv/bin/python bench/bench_scale.py [--sizes 1x8,8x8,64x8,256x8,1024x8] [--rate 1] [--seconds 10]
        [--progress] [--plot bench/results/scale.png]

Writes bench/results/scale.json (and the PNG with --plot: CPU share and decision time versus ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.core.health import HealthSpec  # noqa: E402
from orchestrator.core.jobplan import LaunchPlan, NodePlan  # noqa: E402
from orchestrator.events import Beat, NodeEnded  # noqa: E402
from orchestrator.node.rundir import ExitRecord  # noqa: E402
from orchestrator.supervise import Supervisor  # noqa: E402


class Emulated:
    """A `Running` whose events are emulated: `nodes` x `ranks` ranks heartbeating `rate` times a second, generated
    by a thread of its own into a queue; node 1 (node 0 when alone) fails after `fail_after`
    seconds."""

    decides_hangs_on_nodes = False
    grace = 1.0
    started = True

    def __init__(self, nodes: int, ranks: int, rate: float, fail_after: float, slow_rank: int | None = None):
        import queue
        self.handle = object()
        self.nodes = {n: f"node{n:04d}" for n in range(nodes)}
        self.ranks = ranks
        self.q: queue.Queue = queue.Queue()
        self.rate, self.fail_after, self.slow_rank = rate, fail_after, slow_rank
        self.failed_at: float | None = None  # when the failure's event was handed over (perf_counter)
        self.stopped_at: float | None = None
        self.beats = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._produce, daemon=True)
        self.thread.start()

    def _produce(self) -> None:
        world = len(self.nodes) * self.ranks
        t0 = time.time()
        step = 0
        interval = 1.0 / self.rate
        while not self.done.is_set() and time.time() - t0 < self.fail_after:
            step += 1
            now = time.time()
            batch = [Beat({"t": now, "rank": r, "host": f"node{r // self.ranks:04d}", "step": step, "max_steps": 10**6,
                           "loss": 2.0, "tokens": step * 4096, "event": "step",
                           "compute_s": 0.25 if r == self.slow_rank else 0.1 + 0.001 * (r % 7)})
                     for r in range(world)]
            self.q.put(batch)
            self.beats += len(batch)
            time.sleep(max(0.0, interval - (time.time() - now)))
        bad = self.bad = min(1, len(self.nodes) - 1)
        rec = ExitRecord(returncode=9, time=time.time(), signal=9, launch_returncode=-9,
                         rank_death=f"rank {bad * self.ranks} (pid 4242) died of SIGKILL (exit -9) before finishing")
        self.failed_at = time.perf_counter()
        self.q.put([NodeEnded(bad, self.nodes[bad], 137, "killed", rec)])

    def events(self, timeout: float) -> list:
        import queue
        out: list = []
        try:
            out += self.q.get(timeout=timeout)
        except queue.Empty:
            return out
        while True:
            try:
                out += self.q.get_nowait()
            except queue.Empty:
                return out

    def stop(self, reason: str, grace: float, nodes=None) -> None:
        if self.stopped_at is None:
            self.stopped_at = time.perf_counter()
            self.done.set()
            for n in (nodes or set(self.nodes)):  # every node told to stop: each ends at once here
                if n != getattr(self, "bad", 1):
                    self.q.put([NodeEnded(n, self.nodes[n], 143, "", ExitRecord(returncode=143, time=time.time(),
                                                                                   stop_reason=reason))])

    def stopped_ranks(self, stacks: bool = True) -> dict:
        return {}

    def close(self) -> None:
        self.done.set()


def plan_for(nodes: int, ranks: int, run_dir: str) -> LaunchPlan:
    """A LaunchPlan of `nodes` x `ranks` (what the supervisor reads of it: sizes, hosts, health, run dir)."""
    import dataclasses
    plans = tuple(NodePlan(node_rank=n, host=f"node{n:04d}", ranks=tuple(range(n * ranks, (n + 1) * ranks)),
                           accelerate_config={}, command=(), env={}) for n in range(nodes))
    blank = {f.name: (0 if f.type in ("int", "int | None") else "" if f.type == "str" else None)
             for f in dataclasses.fields(LaunchPlan)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    blank.update(parallelism={}, secret_env=(), tokens_per_step_exact=False)
    return LaunchPlan(**dict(blank, job_id="scale", run_dir=run_dir, nodes=nodes, procs_per_node=ranks,
                             world_size=nodes * ranks, node_plans=plans, cluster_kind="local"),
                      health=HealthSpec(stall_timeout=300, poll_interval=1.0))


def measure(nodes: int, ranks: int, rate: float, seconds: float, progress: bool, run_dir: str,
            slow_rank: int | None = None) -> dict:
    job = Emulated(nodes, ranks, rate, seconds, slow_rank)
    on_beat = None
    if progress:
        from orchestrator.cli.progress import Progress
        prog = Progress(rich=False, stream=open(os.devnull, "w"))
        on_beat = prog.feed
    sup = Supervisor(plan_for(nodes, ranks, run_dir), on_beat=on_beat)
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    box: dict = {}

    def supervise() -> None:
        t0 = time.thread_time()
        box["result"] = sup.run(job)
        box["cpu"] = time.thread_time() - t0

    t = threading.Thread(target=supervise)
    t.start()
    t.join()
    wall = (job.failed_at or time.perf_counter()) - wall0
    del cpu0
    res = box["result"]
    decision = (job.stopped_at - job.failed_at) if job.stopped_at and job.failed_at else None
    return {"nodes": nodes, "ranks_per_node": ranks, "ranks": nodes * ranks, "rate_hz": rate, "seconds": round(wall, 2),
            "heartbeats": job.beats, "heartbeats_per_s": round(job.beats / wall, 1),
            "cpu_s": round(box["cpu"], 3), "cpu_share": round(box["cpu"] / wall, 4),
            "cpu_ms_per_1000_beats": round(1000 * box["cpu"] / max(1, job.beats) * 1000, 3),
            "decision_s": None if decision is None else round(decision, 4), "state": str(res.state),
            "root_cause": res.root_cause[:120],
            "stragglers": [s["rank"] for s in (json.loads(Path(run_dir, "stragglers.json").read_text())["named"]
                                              if Path(run_dir, "stragglers.json").exists() else [])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1x8,8x8,64x8,256x8,1024x8")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--slow-rank", type=int, default=None, help="this rank's compute_s is 2.5x the others'")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    a = ap.parse_args()
    import tempfile
    rows = []
    for size in a.sizes.split(","):
        n, r = (int(x) for x in size.split("x"))
        with tempfile.TemporaryDirectory() as d:
            row = measure(n, r, a.rate, a.seconds, a.progress, d, a.slow_rank)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rate_hz": a.rate, "seconds": a.seconds, "progress": a.progress,
                                       "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["ranks"] for r in rows]
        ax[0].plot(xs, [100 * r["cpu_share"] for r in rows], "o-")
        ax[0].set(xscale="log", xlabel="ranks (heartbeats/s at 1 Hz)", ylabel="supervisor CPU, % of one core",
                  title="supervision cost")
        ax[0].axhline(25, color="r", ls="--", lw=0.8)
        ax[1].plot(xs, [r["decision_s"] for r in rows], "o-")
        ax[1].set(xscale="log", xlabel="ranks", ylabel="seconds", title="rank died -> every node told to stop")
        ax[1].axhline(1, color="r", ls="--", lw=0.8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)


if __name__ == "__main__":
    main()

"""A sweep on SLURM as ONE array job vs the same points as separate submits (not CI; root; the testbed must be up:
scripts/slurm_cluster.sh up --nodes 3).

    python bench/bench_slurm_sweep.py [--points 8] [--repeats 3] [--sleep 3]

Both contenders run the same N points of a 2-node own-code job (`run: script:` that sleeps a few seconds under
`accelerate launch`: what is measured is the orchestration, not training), interleaved, each run started on an idle
cluster:
  array:    `orchestrate submit job.yaml --sweep run.args.seed=1..N --max-parallel N` (one runner, one sbatch)
  separate: N x `orchestrate submit job.yaml run.args.seed=k launch.port=P+k` started at the same moment (a shell loop
            with `&`; a port each, see SEPARATE_PORT)
Measured per run, from the moment the command(s) start: sbatch calls (an `sbatch` shim on PATH logs each; `--test-only`
checks counted apart), when every point's SLURM job exists (squeue, polled every 0.2 s), when every point has been
RUNNING (the testbed's 3 nodes x 2 cores run 3 such 2-node jobs at once, so for N > 3 this is when the LAST point
starts, after earlier ones ended), and when every point is COMPLETED (the command(s) exited 0).
Results: bench/results/slurm_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "slurm"))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("SLURM_CONF", "/tmp/orchestrate-slurm/etc/slurm.conf")

from bench_slurm import idle_cluster  # noqa: E402
from slurm_helpers import WORK  # noqa: E402

CLI = [sys.executable, "-m", "orchestrator.cli"]
# Separate submits get a rendezvous port each (launch.port): with the one default port, two 2-node jobs that SLURM
# puts on the same nodes (the testbed's nodes have 2 cores, each job's task takes 1) collide on it and fail (seen: 2 of
# 8 points FAILED, 'another process is utilizing [port 29500]'). An array's tasks get launch.port + 1 + i themselves.
SEPARATE_PORT = 29600
PAYLOAD = """import os, sys, time
time.sleep({sleep})
print("point", os.environ.get("RANK"), sys.argv[1:], flush=True)
"""


def shim(tmp: Path) -> tuple[Path, Path]:
    import shutil
    real, bin_dir, log = shutil.which("sbatch"), tmp / "bin", tmp / "sbatch-calls.log"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    return bin_dir, log


class Watch:
    """squeue every 0.2 s: when each of our jobs (by name prefix) was first listed, and first RUNNING."""

    def __init__(self, prefix: str, t0: float):
        self.prefix, self.t0 = prefix, t0
        self.seen: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            r = subprocess.run(["squeue", "-h", "-r", "-o", "%i %j %T"], capture_output=True, text=True)
            now = time.monotonic() - self.t0
            for line in r.stdout.splitlines():
                words = line.split()
                if len(words) == 3 and words[1].startswith(self.prefix):
                    self.seen.setdefault(words[0], now)
                    if words[2] in ("RUNNING", "COMPLETING"):
                        self.running.setdefault(words[0], now)
            self.stop.wait(0.2)

    def done(self) -> None:
        self.stop.set()
        self.thread.join()


def one_run(kind: str, n: int, tmp: Path, job_file: Path) -> dict:
    bin_dir, log = shim(tmp / f"{kind}-{time.time_ns()}")
    home = tmp / f"home-{kind}-{time.time_ns()}"
    env = dict(os.environ, ORCHESTRATE_HOME=str(home), PATH=f"{bin_dir}:{os.environ['PATH']}", OMP_NUM_THREADS="1")
    tag = f"b{time.time_ns() % 10**8}"
    common = ["--nodes", "2", "--cluster", str(REPO / "cluster_configs" / "slurm_local.yaml"), "--quiet",
              f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}",
              f"run.args.output_dir={tmp / 'out' / tag}"]
    idle_cluster()
    t0 = time.monotonic()
    if kind == "array":
        watch = Watch("sweep-", t0)
        procs = [subprocess.Popen([*CLI, "submit", str(job_file), *common, "--sweep",
                                   "run.args.seed=" + ",".join(str(k) for k in range(1, n + 1)), "--max-parallel",
                                   str(n)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)]
    else:
        watch = Watch(tag, t0)
        procs = [subprocess.Popen([*CLI, "submit", str(job_file), *common[:-1],
                                   f"run.args.output_dir={tmp / 'out' / tag / str(k)}", f"run.args.seed={k}",
                                   f"launch.port={SEPARATE_PORT + k}", "--job-id", f"{tag}-{k}"], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for k in range(1, n + 1)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    t_done = time.monotonic() - t0
    watch.done()
    calls = log.read_text().splitlines() if log.exists() else []
    codes = [p.returncode for p in procs]
    res = {"kind": kind, "points": n, "exit_codes": codes, "ok": all(c == 0 for c in codes),
           "sbatch_calls": sum(1 for c in calls if not c.startswith("--test-only")),
           "test_only_calls": sum(1 for c in calls if c.startswith("--test-only")),
           "slurm_jobs": len(watch.seen),
           "all_queued_s": round(max(watch.seen.values()), 2) if len(watch.seen) >= n else None,
           "all_started_s": round(max(watch.running.values()), 2) if len(watch.running) >= n else None,
           "first_started_s": round(min(watch.running.values()), 2) if watch.running else None,
           "all_completed_s": round(t_done, 2)}
    if not res["ok"]:
        res["tail"] = [o[-1500:] for o in outs if o][:2]
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=3.0, help="seconds each point's ranks sleep")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "slurm_sweep.json"))
    args = ap.parse_args()
    tmp = WORK / f"bench-sweep-{time.time_ns()}"
    tmp.mkdir(parents=True)
    script = tmp / "point.py"
    script.write_text(PAYLOAD.format(sleep=args.sleep))
    job_file = tmp / "job.yaml"
    job_file.write_text(json.dumps({"run": {"script": str(script), "args": {"output_dir": str(tmp / "out"),
                                                                            "seed": 0}}}))
    runs: list[dict] = []
    for i in range(args.repeats):
        order = ("array", "separate") if i % 2 == 0 else ("separate", "array")
        for kind in order:
            runs.append(one_run(kind, args.points, tmp, job_file))

    def median(kind: str, key: str):
        vals = [r[key] for r in runs if r["kind"] == kind and r.get(key) is not None and r["ok"]]
        return round(statistics.median(vals), 2) if vals else None
    keys = ("sbatch_calls", "test_only_calls", "all_queued_s", "first_started_s", "all_started_s", "all_completed_s")
    summary = {kind: {k: median(kind, k) for k in keys} for kind in ("array", "separate")}
    report = {"what": f"{args.points} points of a 2-node own-code job (ranks sleep {args.sleep:g} s) on the SLURM "
                      "testbed (3 nodes x 2 cores: at most 3 such jobs at once): ONE array job (submit --sweep, "
                      f"--max-parallel {args.points}) vs {args.points} separate `orchestrate submit`s started at once",
              "machine": f"{os.cpu_count()} cores", "repeats": args.repeats, "median": summary, "runs": runs}
    print(json.dumps(report["median"], indent=2))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

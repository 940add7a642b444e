#!/usr/bin/env python3
"""Dispatch cost, local backend (issue #28 item 6; not CI): from `orchestrate submit JOB --nodes 2` starting to both
nodes' `accelerate launch` processes existing, with a warm field cache and a cold one (a new ORCHESTRATE_HOME),
interleaved. The job is own code whose script prints its parent's start time (the `accelerate launch` process, from
the kernel's /proc/PID/stat) and exits: nothing of training is measured, only what orchestrate does before the
launcher starts (the CLI: Python, omegaconf, the plan, the run dir, the store; then each node agent).

    .venv/bin/python bench/bench_dispatch.py [--repeat 6]

Writes bench/results/dispatch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROBE = '''import os, time
def start(pid):
    ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
    return time.time() - (float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
print(f"LAUNCHER_START {start(os.getppid()):.4f}", flush=True)
'''


def one(job: Path, home: Path) -> float:
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2"], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    starts = [float(x) for x in re.findall(r"LAUNCHER_START ([0-9.]+)", out.stdout)]
    if out.returncode != 0 or len(starts) != 2:
        raise SystemExit(f"submit failed ({out.returncode}): {out.stdout[-1500:]}{out.stderr[-1500:]}")
    return max(starts) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dispatch-") as tmp:
        work = Path(tmp)
        (work / "probe.py").write_text(PROBE)
        job = work / "job.yaml"
        job.write_text(json.dumps({"run": {"script": str(work / "probe.py")},
                                   "launch": {"profile": "multi_gpu", "procs_per_node": 1}}))
        warm_home = work / "warm"
        one(job, warm_home)  # fills the warm home's field cache
        runs: dict[str, list[float]] = {"warm": [], "cold": []}
        for i in range(args.repeat):
            runs["cold"].append(one(job, work / f"cold{i}"))
            runs["warm"].append(one(job, warm_home))
            print(f"  {i + 1}: cold {runs['cold'][-1]:.3f} s, warm {runs['warm'][-1]:.3f} s", flush=True)
    res = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "repeat": args.repeat,
           **{f"{k}_median_s": round(statistics.median(v), 3) for k, v in runs.items()},
           **{f"{k}_range_s": [round(min(v), 3), round(max(v), 3)] for k, v in runs.items()}, "runs": runs}
    out = REPO / "bench" / "results" / "dispatch.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

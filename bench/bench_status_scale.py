#!/usr/bin/env python3
"""Operator commands on a big job (issue #29; not CI; a small size runs in tests/unit/test_status_scale.py):
`orchestrate status JOB`, `status JOB --json`, `ls` and `logs JOB --rank R` on a job of N nodes x R ranks, timed as a
user runs them (the CLI in a fresh process, wall time, median of `--repeat`).

The job is a real one as far as these commands can tell: its plan and run dir come from the real planner
(`orchestrate render` of an SSH cluster of N hosts), its store record from the real JobStore, each node's agent.json /
exit.json from the RunDir writers the node agents use, and every rank's heartbeat file holds `--steps` records in
the hooks' format (with compute_s and loss) and each node's log `--log-lines` lines. Two states: RUNNING under a live
supervisor (this process stands in: its pid file names us) and COMPLETED.

    .venv/bin/python bench/bench_status_scale.py [--sizes 8x8,64x8,256x8,1024x8] [--steps 200] [--repeat 5]

Writes bench/results/status_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.node.proctools import process_start_time  # noqa: E402
from orchestrator.node.rundir import AgentRecord, ExitRecord, RunDir  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
JOB_YAML = """run:
  script: %s
launch: {profile: multi_gpu, procs_per_node: %d}
"""


def cli(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **OFFLINE, "ORCHESTRATE_HOME": str(home)}, timeout=600)
    if check and out.returncode != 0:
        raise SystemExit(f"orchestrate {' '.join(args)} exited {out.returncode}: {out.stderr[-2000:]}")
    return out


def make_job(home: Path, work: Path, nodes: int, ranks: int, *, steps: int, log_lines: int, state: str) -> str:
    """A job of `nodes` x `ranks` in `home` (see the module docstring); returns its id."""
    from orchestrator.store import JobStore
    (work / "train.py").write_text("print('hi')\n")
    (work / "job.yaml").write_text(JOB_YAML % (work / "train.py", ranks))
    hosts = [f"10.77.{n // 250}.{n % 250 + 1}" for n in range(nodes)]
    (work / "cluster.yaml").write_text(json.dumps({"name": "big", "kind": "ssh",
                                                   "ssh": {"hosts": hosts, "gpus_per_node": ranks}}))
    job = f"big-{nodes}x{ranks}-{state.lower()}"
    run_dir = home / "runs" / job
    cli(home, "render", str(work / "job.yaml"), "--cluster", str(work / "cluster.yaml"), "--nodes", str(nodes),
        "--out", str(run_dir))
    plan = json.loads((run_dir / "plan.json").read_text())
    store = JobStore(home / "jobs.db")
    store.create(job_id=job, recipe=str(work / "job.yaml"), recipe_digest="0" * 16, cluster="big", backend="ssh",
                 nodes=nodes, world_size=plan["world_size"], run_dir=str(run_dir))
    rd = RunDir(run_dir)
    rd.mkdir(RunDir.HEARTBEATS)
    rd.mkdir(RunDir.LOGS)
    t0 = time.time() - steps
    for node in plan["node_plans"]:
        n = node["node_rank"]
        rd.write_agent(AgentRecord(node_rank=n, host=node["host"], agent_pid=1, agent_pgid=1, pid=2, pgid=2,
                                   main_ip=hosts[0], started=t0, token="x" * 16))
        for g in node["ranks"]:
            with open(rd.heartbeats / f"rank{g}.jsonl", "w") as f:
                for s in range(1, steps + 1):
                    f.write(json.dumps({"t": t0 + s, "rank": g, "host": node["host"], "step": s, "max_steps": steps,
                                        "loss": 3.0 / s ** 0.3, "tokens": s * 4096, "event": "step",
                                        "compute_s": 0.1 + 0.001 * (g % 7)}) + "\n")
                if state == "COMPLETED":
                    f.write(json.dumps({"t": t0 + steps + 1, "rank": g, "host": node["host"], "step": steps,
                                        "event": "end"}) + "\n")
        with open(rd.path(f"{RunDir.LOGS}/node{n}.log"), "w") as f:
            for i in range(log_lines):
                f.write(f"[rank{node['ranks'][i % ranks]}]: step {i} loss 1.234 lr 1e-3\n")
        if state == "COMPLETED":
            rd.write_exit(n, ExitRecord(returncode=0, time=t0 + steps + 2, launch_returncode=0, host=node["host"]))
    if state == "COMPLETED":
        store.update(job, "COMPLETED", detail="done", exit_code=0, final=True)
    else:
        store.update(job, "RUNNING", detail="running")
        sup = home / "supervisors"
        sup.mkdir(exist_ok=True)
        (sup / f"{job}.pid").write_text(f"{os.getpid()} {process_start_time()}\n")
    return job


def timed(home: Path, *args: str) -> float:
    t = time.perf_counter()
    cli(home, *args)
    return time.perf_counter() - t


def write_results(out: str, rows: list[dict]) -> None:
    """The rows, with when and on how many CPUs they were measured, to `out` (JSON)."""
    Path(out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                                     "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8x8,64x8,256x8,1024x8")
    ap.add_argument("--steps", type=int, default=200, help="heartbeat records per rank")
    ap.add_argument("--log-lines", type=int, default=2000, help="lines per node log")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "status_scale.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="status-scale-") as tmp:
        for size in args.sizes.split(","):
            nodes, ranks = (int(x) for x in size.split("x"))
            for state in ("RUNNING", "COMPLETED"):
                home, work = Path(tmp) / f"home-{size}-{state}", Path(tmp) / f"work-{size}-{state}"
                home.mkdir()
                work.mkdir()
                job = make_job(home, work, nodes, ranks, steps=args.steps, log_lines=args.log_lines, state=state)
                last = str(nodes * ranks - 1)
                cmds = {"status": ("status", job), "status --json": ("status", job, "--json"), "ls": ("ls",),
                        "logs --rank": ("logs", job, "--rank", last)}
                times: dict[str, list[float]] = {k: [] for k in cmds}
                for _ in range(args.repeat):  # interleaved
                    for k, a in cmds.items():
                        times[k].append(timed(home, *a))
                row = {"nodes": nodes, "ranks_per_node": ranks, "ranks": nodes * ranks, "state": state,
                       "steps_per_rank": args.steps, "log_lines_per_node": args.log_lines,
                       **{f"{k}_s": round(statistics.median(v), 3) for k, v in times.items()},
                       **{f"{k}_range_s": [round(min(v), 3), round(max(v), 3)] for k, v in times.items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()

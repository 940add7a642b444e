#!/usr/bin/env python3
"""Dispatch cost, local backend (issue #28 item 6; not CI): from `orchestrate submit JOB --nodes 2` starting to both
nodes' `accelerate launch` processes existing, with a warm field cache and a cold one (a new ORCHESTRATE_HOME),
interleaved. The job is own code whose script prints the start times of its parent (the `accelerate launch` process)
and grandparent (the node agent), from the kernel's /proc/PID/stat, and exits: nothing of training is measured, only
what orchestrate does before the launcher starts, in two phases: `cli` (the submit's start -> the first node agent
exists: Python, the plan, the run dir, the store) and `agent` (a node agent's start -> its launcher exists; the mean of
the two nodes).

    .venv/bin/python bench/bench_dispatch.py [--repeat 6] [--ref REV]

--ref REV runs the same warm submit with orchestrate at git revision REV as a third side in every round (from `git
archive`, byte-compiled alike) and reports each phase paired: this tree minus REV, round by round. Each warm side also
times the CPU of a `submit --dry-run` (`dry_run_cpu`: steady where the wall times scatter on a shared machine).
Orchestrate's modules are byte-compiled first, as pip installs them (PYTHONDONTWRITEBYTECODE or not). Writes
bench/results/dispatch.json.
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
def stat(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
def start(pid):
    ticks = int(stat(pid)[19])
    return time.time() - (float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
launcher = os.getppid()
print(f"LAUNCHER_START {start(launcher):.4f} AGENT_START {start(int(stat(launcher)[1])):.4f}", flush=True)
'''
PHASES = ("total", "cli", "agent")


def compile_tree(root: Path) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(root / d) for d in ("orchestrator", "launchers",
                                                                                         "recipes"))], check=True)


def one(job: Path, home: Path, tree: Path = REPO) -> dict[str, float]:
    """One submit: {total, cli, agent} seconds."""
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(tree)}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2"], env=env,
                         cwd=tree, capture_output=True, text=True, timeout=300)
    found = re.findall(r"LAUNCHER_START ([0-9.]+) AGENT_START ([0-9.]+)", out.stdout)
    if out.returncode != 0 or len(found) != 2:
        raise SystemExit(f"submit failed ({out.returncode}): {out.stdout[-1500:]}{out.stderr[-1500:]}")
    launchers, agents = [float(x) for x, _ in found], [float(y) for _, y in found]
    return {"total": max(launchers) - t0, "cli": min(agents) - t0,
            "agent": statistics.mean(x - y for x, y in zip(launchers, agents, strict=True))}


def dry_run_cpu(job: Path, home: Path, tree: Path = REPO) -> float:
    """CPU seconds (user + sys) of one `submit --dry-run` of the same job: the CLI's validation and planning without
    the run dir, the store and the agents; unlike the wall times it barely moves when other work shares the cores."""
    import resource
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2", "--dry-run"],
                   env=env, cwd=tree, capture_output=True, check=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summary(values: list[float]) -> dict[str, float | list[float]]:
    return {"median_s": round(statistics.median(values), 3), "range_s": [round(min(values), 3), round(max(values), 3)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--ref", default=None, help="a git revision to run as a third side, paired (e.g. main)")
    args = ap.parse_args()
    compile_tree(REPO)
    with tempfile.TemporaryDirectory(prefix="bench-dispatch-") as tmp:
        work = Path(tmp)
        (work / "probe.py").write_text(PROBE)
        job = work / "job.yaml"
        job.write_text(json.dumps({"run": {"script": str(work / "probe.py")},
                                   "launch": {"profile": "multi_gpu", "procs_per_node": 1}}))
        sides: dict[str, tuple[Path, Path | None]] = {"cold": (REPO, None), "warm": (REPO, work / "warm")}
        if args.ref:
            ref = work / "ref"
            ref.mkdir()
            archive = subprocess.run(["git", "archive", args.ref], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(ref)], input=archive, check=True)
            compile_tree(ref)
            sides["ref"] = (ref, work / "ref-home")
        for tree, home in sides.values():
            if home is not None:
                one(job, home, tree)  # fills that home's field cache
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for i in range(args.repeat):
            for side, (tree, home) in sides.items():
                runs[side].append(one(job, home or work / f"cold{i}", tree))
                if home is not None:
                    runs[side][-1]["dry_run_cpu"] = dry_run_cpu(job, home, tree)
            print(f"  {i + 1}: " + ", ".join(f"{side} {' '.join(f'{p} {r[-1][p]:.3f}' for p in PHASES)}"
                                            for side, r in runs.items()), flush=True)
    res: dict = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "repeat": args.repeat,
                 "ref": args.ref, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    for side, rows in runs.items():
        res[side] = {p: summary([r[p] for r in rows]) for p in (*PHASES, "dry_run_cpu") if p in rows[0]}
    if args.ref:
        pairs = list(zip(runs["warm"], runs["ref"], strict=True))
        res["paired_warm_minus_ref"] = {p: summary([a[p] - b[p] for a, b in pairs]) for p in (*PHASES, "dry_run_cpu")}
    res["runs"] = runs
    out = REPO / "bench" / "results" / "dispatch.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    for side in runs:
        print(f"{side:5s} " + "  ".join(f"{p} {v['median_s']:.3f} ({v['range_s'][0]:.3f}-{v['range_s'][1]:.3f})"
                                         for p, v in res[side].items()))
    if args.ref:
        print("warm - ref, paired: " + "  ".join(f"{p} {v['median_s']:+.3f} ({v['range_s'][0]:+.3f} to "
                                                 f"{v['range_s'][1]:+.3f})"
                                                 for p, v in res["paired_warm_minus_ref"].items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

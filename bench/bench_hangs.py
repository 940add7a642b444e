#!/usr/bin/env python3
"""Hang diagnosis (issue #34), not CI.

1. accuracy: tests/own_code/train_misbehave.py on 2 local nodes x 2 ranks (a plain gloo loop, no orchestrate
   imports), one rank misbehaving at step 12 in each of five ways (sleep, lock, busy, stop, desync), --runs runs
   each, submitted through the CLI of the checkout --repo (this one, or /work/main for "before"). A run is right
   when the first rank its root cause names (`rank N`) is the misbehaving one. Also the seconds from the
   misbehaviour (the rank's own print) to the teardown (outcome.json teardown_at), and where kept, the evidence's
   collection time (asked -> diagnosis.json).
2. overhead: the flight recorder + responder on vs off (ORCHESTRATE_HANG_EVIDENCE=0), tests/own_code/train_plain.py
   under torchrun (2 ranks, gloo, the hooks on PYTHONPATH as a launch puts them), alternating on/off runs (the
   recorder's buffer is fixed when the process group is made: it cannot be toggled inside one run), --pairs pairs;
   per pair the relative difference of the training loop's time (rank 0), median and spread.
3. stragglers: rank 1 slow in its data path vs an even run, and rank 1 of a compute-bound plain loop
   (tests/own_code/train_plain.py 1200) under a SIGSTOP / SIGCONT duty cycle (stopped 20 ms of every 40 ms,
   tests/badnodes.Throttler) vs the same loop even, --runs each (--straggler-modes): who is named, by which evidence.
4. analysis: core.hangs.diagnose over 1,024 x 8 ranks' synthetic evidence (57 collectives each, one culprit, one
   desync), median of 3.

    .venv/bin/python bench/bench_hangs.py [--repo DIR] [--runs 5] [--modes sleep,lock,busy,stop,desync]
        [--pairs 8] [--steps 3000] [--skip accuracy,overhead,analysis,stragglers]
        [--straggler-modes slow,even,duty,even_plain] [--out bench/results/hangs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = str(REPO / ".venv" / "bin" / "python")
RANK_OF = {"sleep": 2, "lock": 1, "busy": 3, "stop": 1, "desync": 0}


def accuracy(repo: Path, runs: int, modes: list[str]) -> dict:
    out: dict = {}
    home = Path(tempfile.mkdtemp(prefix="bench-hangs-home-"))
    for i in range(runs):
        for mode in modes:  # interleaved: each mode once per round
            rank = RANK_OF[mode]
            with tempfile.TemporaryDirectory() as d:
                shutil.copy(REPO / "tests" / "own_code" / "train_misbehave.py", Path(d) / "train.py")
                (Path(d) / "job.yaml").write_text(f"run: {{script: train.py, args: ['400', '{rank}', '12', "
                                                  f"'{mode}']}}\nhealth: {{stall_timeout: 4, startup_timeout: 120}}\n")
                env = {**os.environ, "PYTHONPATH": str(repo), "ORCHESTRATE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
                r = subprocess.run([PY, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2",
                                    "--procs-per-node", "2"], cwd=d, env=env, capture_output=True, text=True,
                                   timeout=400)
            text = r.stdout + r.stderr
            m = re.search(r"^job (\S+) FAILED: (.*)$", text, re.MULTILINE)
            cause = m.group(2) if m else ""
            named = re.search(r"rank (\d+)", cause)
            first = int(named.group(1)) if named else None
            bad_t = re.search(r"MISBEHAVE rank \d+ at step \d+ \(\w+\) t=([\d.]+)", text)
            row = {"run": i, "right": first == rank, "first": first, "cause": cause[:400]}
            if m:
                rd = home / "runs" / m.group(1)
                outcome = json.loads((rd / "outcome.json").read_text()) if (rd / "outcome.json").exists() else {}
                if bad_t and outcome.get("teardown_at"):
                    row["to_teardown_s"] = round(outcome["teardown_at"] - float(bad_t.group(1)), 2)
                diag = json.loads((rd / "diagnosis.json").read_text()) if (rd / "diagnosis.json").exists() else {}
                asked = [json.loads(p.read_text()).get("asked") for p in (rd / "hangs").glob("rank*.status.json")]
                if diag.get("t") and asked:
                    row["collect_s"] = round(diag["t"] - min(a for a in asked if a), 2)
                    if bad_t:
                        row["to_root_cause_s"] = round(diag["t"] - float(bad_t.group(1)), 2)
            out.setdefault(mode, []).append(row)
            print(f"  {mode} run {i}: right={row['right']} {row.get('to_teardown_s')} s  {cause[:150]}", flush=True)
    shutil.rmtree(home, ignore_errors=True)
    summary = {}
    def med(rows: list, k: str) -> float | None:
        v = [r[k] for r in rows if k in r]
        return round(statistics.median(v), 2) if v else None
    for mode, rows in out.items():
        summary[mode] = {"right": sum(r["right"] for r in rows), "runs": len(rows),
                         "to_teardown_s": med(rows, "to_teardown_s"), "to_root_cause_s": med(rows, "to_root_cause_s"),
                         "collect_s": med(rows, "collect_s"),
                         "collect_max_s": max((r["collect_s"] for r in rows if "collect_s" in r), default=None)}
    return {"repo": str(repo), "summary": summary, "runs": out}


def stragglers(repo: Path, runs: int, modes: tuple[str, ...] = ("slow", "even", "duty", "even_plain")) -> dict:
    """Rank 1 slow in its data path (0.05 s a step more, train_misbehave.py `slow`, 90 steps) vs an even run (`even`),
    and rank 1 of train_plain.py (1200 steps, compute-bound) under a SIGSTOP duty cycle (`duty`) vs the same loop even
    (`even_plain`), --runs each, interleaved, window 20, factor 1.3: which ranks are named (stragglers.json) and by
    which evidence."""
    sys.path.insert(0, str(REPO / "tests"))
    from badnodes import Throttler, job_ids, ranks_of
    out: dict = {m: [] for m in modes}
    home = Path(tempfile.mkdtemp(prefix="bench-hangs-home-"))
    for i in range(runs):
        for mode in modes:
            plain = mode in ("duty", "even_plain")
            with tempfile.TemporaryDirectory() as d:
                shutil.copy(REPO / "tests" / "own_code" / ("train_plain.py" if plain else "train_misbehave.py"),
                            Path(d) / "train.py")
                args = "['1200']" if plain else f"['90', '1', '2', '{mode}']"
                (Path(d) / "job.yaml").write_text(f"run: {{script: train.py, args: {args}}}\n"
                                                  "health: {stall_timeout: 60, startup_timeout: 120, "
                                                  "straggler: {window: 20, factor: 1.3}}\n")
                env = {**os.environ, "PYTHONPATH": str(repo), "ORCHESTRATE_HOME": str(home)}
                before = set(job_ids(home))
                throttle = Throttler(lambda seen=before: next((ranks_of(j).get(1) for j in job_ids(home)
                                                               if j not in seen), None),
                                     stop_s=0.02, period_s=0.04) if mode == "duty" else None
                try:
                    r = subprocess.run([PY, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2",
                                        "--procs-per-node", "2"], cwd=d, env=env, capture_output=True, text=True,
                                       timeout=400)
                finally:
                    if throttle:
                        throttle.stop()
            m = re.search(r"^job (\S+) (COMPLETED|FAILED|CANCELLED)", r.stdout + r.stderr, re.MULTILINE)
            named, data = [], {}
            if m:
                p = home / "runs" / m.group(1) / "stragglers.json"
                data = json.loads(p.read_text()) if p.exists() else {}
                named = [(s.get("rank"), s.get("measure") or s.get("evidence", "forward"), s.get("step"),
                          s.get("median_s")) for s in data.get("named") or []]
            out[mode].append({"state": m.group(2) if m else None, "named": named,  # (the evidence at the end:)
                              "wait_share": data.get("wait_share") if m else None})
            print(f"  {mode} run {i}: {m.group(2) if m else '?'} named {named} wait share {data.get('wait_share')}",
                  flush=True)
    shutil.rmtree(home, ignore_errors=True)
    res: dict = {"repo": str(repo), "runs": out, "n": runs}
    for mode, rows in out.items():
        if mode.startswith("even"):
            res[f"{mode}_named_anyone"] = sum(bool(x["named"]) for x in rows)
        else:
            res[f"{mode}_named_rank1"] = sum(any(n[0] == 1 for n in x["named"]) for x in rows)
            res[f"{mode}_named_other"] = sum(any(n[0] != 1 for n in x["named"]) for x in rows)
    return res


def overhead(pairs: int, steps: int) -> dict:
    from orchestrator.node.hooks import HOOKS_DIR
    script = REPO / "tests" / "own_code" / "train_plain.py"
    rows = []
    for i in range(pairs):
        pair = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            with tempfile.TemporaryDirectory() as d:
                env = {**os.environ, "PYTHONPATH": HOOKS_DIR, "ORCHESTRATE_HEARTBEAT_DIR": d,
                       "ORCHESTRATE_RUN_DIR": d, "OMP_NUM_THREADS": "1",
                       "ORCHESTRATE_HANG_EVIDENCE": "1" if on else "0"}
                r = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                                    str(29700 + i), str(script), str(steps)], env=env, capture_output=True, text=True,
                                   timeout=600)
                res = [json.loads(x.split(" ", 1)[1]) for x in r.stdout.splitlines() if x.startswith("PLAIN_RESULT")]
                pair[on] = next(x["loop_s"] for x in res if x["rank"] == 0)
        rel = (pair[True] - pair[False]) / pair[False]
        rows.append({"on_s": round(pair[True], 3), "off_s": round(pair[False], 3), "rel": round(rel, 4)})
        print(f"  pair {i}: on {pair[True]:.3f}s off {pair[False]:.3f}s ({rel * 100:+.2f} %)", flush=True)
    rels = sorted(r["rel"] for r in rows)
    return {"steps": steps, "pairs": rows, "median_rel": round(statistics.median(rels), 4),
            "min_rel": rels[0], "max_rel": rels[-1]}


SAMPLER = """
import os, pickle, statistics, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(600):
    dist.all_reduce(t)
ts = []
for _ in range(30):
    t0 = time.perf_counter()
    data = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))
    ts.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print("SAMPLER", len(data["entries"]), statistics.median(ts), max(ts))
dist.destroy_process_group()
"""


def sampler_cost() -> dict:
    """What the arrival sampler costs a rank: one recorder read (dump + unpickle, the buffer full at 256 entries)
    every ARRIVAL_S seconds, measured in a 2-rank gloo job."""
    from orchestrator.node.hooks.orchestrate_hangs import ARRIVAL_S, BUFFER
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "s.py").write_text(SAMPLER)
        r = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29790",
                            str(Path(d) / "s.py")], env={**os.environ, "TORCH_FR_BUFFER_SIZE": BUFFER,
                                                          "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=300)
    line = next(x for x in r.stdout.splitlines() if x.startswith("SAMPLER"))
    _, n, med, worst = line.split()
    return {"entries": int(n), "read_median_s": round(float(med), 5), "read_max_s": round(float(worst), 5),
            "every_s": ARRIVAL_S, "share_of_wall": round(float(med) / ARRIVAL_S, 5)}


def analysis() -> dict:
    sys.path.insert(0, str(REPO))
    from orchestrator.core.hangs import Entry, RankEvidence, diagnose
    wait = (("/u/train.py", 30, "main", "dist.all_reduce(t)"),
            ("/v/site-packages/torch/distributed/distributed_c10d.py", 3000, "all_reduce", ""))
    sleep = (("/u/train.py", 41, "load_batch", "time.sleep(600)"),)

    def entries(n: int, last: str = "all_reduce") -> tuple:
        return tuple(Entry(i, "all_reduce" if i < n else last, "0", "scheduled", ((4,),), 100.0 + i)
                     for i in range(1, n + 1))
    n = 8192
    ev = [RankEvidence(r, entries=entries(56) if r == 5000 else entries(57, "all_gather" if r == 7001 else
                                                                             "all_reduce"),
                       main_stack=sleep if r == 5000 else wait) for r in range(n)]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        d = diagnose(ev, n)
        times.append(time.perf_counter() - t0)
    return {"ranks": n, "entries_per_rank": 57, "median_s": round(statistics.median(times), 3),
            "times_s": [round(t, 3) for t in times], "culprits": list(d.culprits[:2]), "line": d.line}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=str(REPO))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default=",".join(RANK_OF))
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--skip", default="")
    ap.add_argument("--straggler-modes", default="slow,even,duty,even_plain")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "hangs.json"))
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    res: dict = {"t": time.time()}
    if "analysis" not in skip:
        res["analysis"] = analysis()
        print("analysis:", json.dumps({k: v for k, v in res["analysis"].items() if k != "line"}), flush=True)
    if "sampler" not in skip:
        res["sampler"] = sampler_cost()
        print("sampler:", json.dumps(res["sampler"]), flush=True)
    if "overhead" not in skip:
        res["overhead"] = overhead(a.pairs, a.steps)
        print("overhead:", json.dumps({k: v for k, v in res["overhead"].items() if k != "pairs"}), flush=True)
    if "stragglers" not in skip:
        res["stragglers"] = stragglers(Path(a.repo), a.runs, tuple(a.straggler_modes.split(",")))
        print("stragglers:", json.dumps({k: v for k, v in res["stragglers"].items() if k != "runs"}), flush=True)
    if "accuracy" not in skip:
        res["accuracy"] = accuracy(Path(a.repo), a.runs, a.modes.split(","))
        print("accuracy:", json.dumps(res["accuracy"]["summary"]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

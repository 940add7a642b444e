#!/usr/bin/env python3
"""Hang diagnosis (issue #34), not CI.

1. accuracy: tests/own_code/train_misbehave.py on 2 local nodes x 2 ranks (a plain gloo loop, no orchestrate
   imports), one rank misbehaving at step 12 in each of five ways (sleep, lock, busy, stop, desync), --runs runs
   each, submitted through the CLI of the checkout --repo (this one, or /work/main for "before"). A run is right
   when the first rank its root cause names (`rank N`) is the misbehaving one. Also the seconds from the
   misbehaviour (the rank's own print) to the teardown (outcome.json teardown_at), and where kept, the evidence's
   collection time (asked -> diagnosis.json).
2. overhead (issue #34 item 1: "paired, blocks inside a run"). torch's flight recorder is on by default (2000
   entries; orchestrate sizes it to 256) and fixed when the process group is made; the responder waits in open()
   of its FIFO (no CPU); the arrival sampler reads the recorder every 2 s. So: (a) in one run of a 2-rank gloo DDP
   loop (a ~2 ms step: the worst case), the sampler is switched on and off in ABBA blocks of --block steps, rank 0
   times each block, and each block's reads are self-timed (the slowest rank's); --block-runs runs; per adjacent
   pair the relative difference (median, mean, standard error) and the reads' share of the block; (b) the recorder's
   own cost per collective: a one-process gloo group, TORCH_FR_BUFFER_SIZE 0 / 256 / unset, rotating, --record-rounds
   rounds; with (a)'s collectives per step and step time, its share of the step.
3. stragglers: rank 1 slow in its data path vs an even run, and rank 1 of a compute-bound plain loop
   (tests/own_code/train_plain.py 1200) under a SIGSTOP / SIGCONT duty cycle (stopped 20 ms of every 40 ms,
   tests/badnodes.Throttler) vs the same loop even, --runs each (--straggler-modes): who is named, by which evidence.
4. analysis: core.hangs.diagnose over 1,024 x 8 ranks' synthetic evidence (57 collectives each, one culprit, one
   desync), median of 3.
5. collection at scale: the submit host's side of a hang over SSH hosts without a shared filesystem at --nodes x 8
   ranks (every node's `--diagnose` answer, a real responder's evidence per rank, absorbed; then load + analysis).

    .venv/bin/python bench/bench_hangs.py [--repo DIR] [--runs 5] [--modes sleep,lock,busy,stop,desync]
        [--block 3000] [--blocks 16] [--block-runs 3] [--record-rounds 9] [--nodes 1024]
        [--skip accuracy,overhead,analysis,stragglers,sampler,collection]
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


BLOCKS = """
import json, os, sys, time
import torch, torch.distributed as dist
import orchestrate_hangs  # (the hooks' own module: sitecustomize started its threads)
width, block, blocks, warm = (int(x) for x in sys.argv[1:5])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(dist.get_rank())
def steps(n):
    for _ in range(n):
        x = torch.randn(16, 32, generator=gen)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
steps(warm)
seq0 = orchestrate_hangs._fr()[0].get("entries", [{}])[-1].get("collective_seq_id", 0)
rows = []
for b in range(blocks):
    on = (b % 4) in (0, 3)  # ABBA: on off off on ...
    (orchestrate_hangs.SAMPLING.set if on else orchestrate_hangs.SAMPLING.clear)()
    dist.barrier()
    read0 = orchestrate_hangs.STATS["read_s"]
    t0 = time.perf_counter()
    steps(block)
    took = time.perf_counter() - t0
    mine = torch.tensor([orchestrate_hangs.STATS["read_s"] - read0])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the rank whose reads took longest: what the others wait for
    rows.append([on, took, mine.item()])
seq1 = orchestrate_hangs._fr()[0].get("entries", [{}])[-1].get("collective_seq_id", 0)
if dist.get_rank() == 0:
    sys.stdout.write("BLOCKS " + json.dumps({"rows": rows, "collectives": seq1 - seq0,
                                             "steps": blocks * block}) + "\\n")
dist.destroy_process_group()
"""


def blocks_in_a_run(width: int, block: int, blocks: int, runs: int, every: float = 0.0) -> dict:
    """The hang evidence's cost inside one run (issue #34 item 1): torch's flight recorder is on by default (2000
    entries; orchestrate sizes it to BUFFER) and fixed when the process group is made; the responder waits in open()
    of its FIFO (no CPU); the arrival sampler reads the recorder every ARRIVAL_S s. So the sampler is what is switched,
    in ABBA blocks of `block` steps of a 2-rank gloo DDP loop (rank 0 times each block), with ARRIVAL_S 2 s as
    shipped (`every` > 0: the sampler reads every `every` s instead: its cost amplified ARRIVAL_S / every times, to be
    seen above the noise). Per adjacent on/off pair the relative difference; median and spread over every pair."""
    from orchestrator.node.hooks import HOOKS_DIR
    from orchestrator.node.hooks.orchestrate_hangs import ARRIVAL_S
    rels, step_ms, per_step, shares = [], [], [], []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "blocks.py").write_text(BLOCKS)
            (Path(d) / "hb").mkdir()
            env = {**os.environ, "PYTHONPATH": HOOKS_DIR, "ORCHESTRATE_HEARTBEAT_DIR": str(Path(d) / "hb"),
                   "ORCHESTRATE_RUN_DIR": d, "OMP_NUM_THREADS": "1"}
            if every:
                env["ORCHESTRATE_ARRIVAL_S"] = str(every)
            r = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                                str(29760 + i), str(Path(d) / "blocks.py"), str(width), str(block), str(blocks),
                                str(block)], env=env, capture_output=True, text=True, timeout=1200)
        line = next((x for x in r.stdout.splitlines() if x.startswith("BLOCKS ")), None)
        if line is None:
            raise SystemExit(f"blocks run failed:\n{r.stdout[-2000:]}\n{r.stderr[:3000]}")
        res = json.loads(line.split(" ", 1)[1])
        rows = res["rows"]
        for k in range(0, len(rows) - 1, 2):  # (on, off), (off, on), ...: each adjacent pair once
            t = {on: s for on, s, _ in rows[k:k + 2]}
            rels.append((t[True] - t[False]) / t[False])
        shares.extend(read / s for on, s, read in rows if on)
        step_ms.append(statistics.median(s for _, s, _ in rows) / block * 1000)
        per_step.append(res["collectives"] / res["steps"])
        print(f"  run {i}: step {step_ms[-1]:.2f} ms, {per_step[-1]:.2f} collectives/step, pairs "
              + " ".join(f"{x * 100:+.1f}%" for x in rels[-(len(rows) // 2):]), flush=True)
    rels.sort()
    q = len(rels) // 4
    return {"width": width, "arrival_s": every or ARRIVAL_S, "block_steps": block, "blocks_per_run": blocks,
            "runs": runs, "pairs": len(rels),
            "step_ms": round(statistics.median(step_ms), 3),
            "collectives_per_step": round(statistics.median(per_step), 3),
            "median_rel": round(statistics.median(rels), 4), "mean_rel": round(statistics.fmean(rels), 4),
            "sem_rel": round(statistics.stdev(rels) / len(rels) ** 0.5, 4),
            "self_timed_share": {"median": round(statistics.median(shares), 5), "max": round(max(shares), 5)},
            "q1_rel": round(rels[q], 4), "q3_rel": round(rels[-q - 1], 4),
            "min_rel": round(rels[0], 4), "max_rel": round(rels[-1], 4)}


RECORD = """
import json, sys, time
import torch, torch.distributed as dist
n, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(4)
for _ in range(500):
    dist.all_reduce(t)
t0 = time.perf_counter()
for _ in range(n):
    dist.all_reduce(t)
sys.stdout.write("RECORD " + json.dumps({"us": (time.perf_counter() - t0) / n * 1e6}) + "\\n")
dist.destroy_process_group()
"""


def recorder_cost(rounds: int, n: int) -> dict:
    """What torch's flight recorder costs each collective: a one-process gloo group (no peer to wait for, so the
    recorder's own cost is not lost in the noise of a 2-process round trip on 2 cores), n all_reduces of 4 floats per
    process, with TORCH_FR_BUFFER_SIZE 0 (off), BUFFER (orchestrate's size) and unset (torch's default, 2000: on),
    in rotating order, `rounds` rounds; per round the difference to off, in microseconds per collective."""
    from orchestrator.node.hooks.orchestrate_hangs import BUFFER
    sizes = {"off": "0", "orchestrate": BUFFER, "torch_default": None}
    per: dict[str, list[float]] = {k: [] for k in sizes}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "record.py").write_text(RECORD)
        for i in range(rounds):
            for name in list(sizes)[i % 3:] + list(sizes)[:i % 3]:
                env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE",
                                                                        "TORCH_NCCL_TRACE_BUFFER_SIZE")}
                if sizes[name] is not None:
                    env["TORCH_FR_BUFFER_SIZE"] = sizes[name]
                env["OMP_NUM_THREADS"] = "1"
                r = subprocess.run([PY, str(Path(d) / "record.py"), str(n), str(29730 + i % 20)], env=env,
                                   capture_output=True, text=True, timeout=600)
                line = next((x for x in r.stdout.splitlines() if x.startswith("RECORD ")), None)
                if line is None:
                    raise SystemExit(f"recorder run failed:\n{r.stderr[-3000:]}")
                per[name].append(json.loads(line.split(" ", 1)[1])["us"])
            print(f"  round {i}: " + ", ".join(f"{k} {v[-1]:.1f} us" for k, v in per.items()), flush=True)
    out: dict = {"collectives_per_process": n, "rounds": rounds}
    for k, v in per.items():
        out[f"{k}_us"] = round(statistics.median(v), 2)
        if k != "off":
            diffs = sorted(a - b for a, b in zip(v, per["off"], strict=True))
            out[f"{k}_minus_off_us"] = {"median": round(statistics.median(diffs), 2), "min": round(diffs[0], 2),
                                        "max": round(diffs[-1], 2)}
    return out


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


TEMPLATE = """
import os, sys, time
import torch, torch.distributed as dist
import orchestrate_hangs
dist.init_process_group("gloo")
t = torch.ones(1024)
for _ in range(57):
    dist.all_reduce(t)
import threading  # (asked from another thread, as the responder is: the main thread's stack is kept)
w = threading.Thread(target=orchestrate_hangs.write_evidence, args=(sys.argv[1], dist.get_rank()))
w.start()
w.join()
dist.destroy_process_group()
"""


def collection(nodes: int, ppn: int) -> dict:
    """The submit host's side of a hang's collection at `nodes` x `ppn` ranks over SSH without a shared filesystem
    (each node's `--diagnose` runs on its own host, in parallel, bounded by launchers.ssh.job.diagnose's timeout;
    its answer carries its ranks' evidence, node.hangevidence.export): every node's answer absorbed into one run dir,
    then diagnose_run (load + analysis + diagnosis.json). The evidence is a real responder's file (a 2-rank gloo run,
    57 all_reduces, orchestrate_hangs.write_evidence), copied to every rank: one rank never entered #57, one is in
    all_gather #57, one rank's stack differs."""
    sys.path.insert(0, str(REPO))
    from orchestrator.node.hangevidence import absorb, diagnose_run
    from orchestrator.node.hooks import HOOKS_DIR
    from orchestrator.node.rundir import RunDir
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "t.py").write_text(TEMPLATE)
        r = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29795",
                            str(Path(d) / "t.py"), d], env={**os.environ, "PYTHONPATH": HOOKS_DIR,
                                                            "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=300)
        try:
            tpl = json.loads((Path(d) / "rank0.json").read_text())
        except OSError:
            raise SystemExit(f"template run failed:\n{r.stderr[-3000:]}") from None
    n = nodes * ppn
    culprit, desync = n // 2 + 3, n - 5
    last = max(e["collective_seq_id"] for e in tpl["fr"]["entries"])
    main = next(s for s in tpl["stacks"] if s.get("main"))
    asked = time.time()

    def evidence(g: int) -> str:
        ev = dict(tpl, rank=g, host=f"node{g // ppn:04d}", t=asked + 0.2)
        entries = tpl["fr"]["entries"]
        if g == culprit:
            entries = [e for e in entries if e["collective_seq_id"] != last]
            ev["stacks"] = [dict(main, frames=[["/u/train.py", 41, "load_batch", "time.sleep(600)"]])]
        elif g == desync:
            entries = [dict(e, profiling_name="gloo:all_gather") if e["collective_seq_id"] == last else e
                       for e in entries]
        ev["fr"] = dict(tpl["fr"], entries=entries)
        return json.dumps(ev)
    answers = []
    for node in range(nodes):
        files = {}
        for g in range(node * ppn, (node + 1) * ppn):
            files[RunDir.hang_status_rel(g)] = json.dumps({"rank": g, "pid": 1000 + g, "status": "answered",
                                                          "asked": asked, "took_s": 0.2})
            files[RunDir.hang_evidence_rel(g)] = evidence(g)
        answers.append(json.dumps({"node_rank": node, "hangs": files}))  # what the node prints over SSH
    with tempfile.TemporaryDirectory() as d:
        rd = RunDir(Path(d))
        t0 = time.perf_counter()
        for line in answers:  # (launchers.ssh.job.diagnose: json.loads + absorb per node)
            absorb(rd, json.loads(line)["hangs"])
        t_absorb = time.perf_counter() - t0
        t0 = time.perf_counter()
        diag = diagnose_run(rd, n, since=asked - 1.0)
        t_diag = time.perf_counter() - t0
        body = rd.diagnosis()
    assert diag is not None
    return {"nodes": nodes, "ranks": n, "entries_per_rank": len(tpl["fr"]["entries"]),
            "answer_bytes_per_node": round(statistics.median(len(a) for a in answers)),
            "absorb_s": round(t_absorb, 2), "load_and_analysis_s": round(t_diag, 2),
            "analysis_s": body.get("analysis_s"), "submit_host_s": round(t_absorb + t_diag, 2),
            "culprits": list(diag.culprits[:2]), "expected": [culprit, desync], "line": diag.line}


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
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block", type=int, default=3000)
    ap.add_argument("--block-runs", type=int, default=3)
    ap.add_argument("--record-rounds", type=int, default=9)
    ap.add_argument("--skip", default="")
    ap.add_argument("--straggler-modes", default="slow,even,duty,even_plain")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "hangs.json"))
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    res: dict = {"t": time.time()}
    if "analysis" not in skip:
        res["analysis"] = analysis()
        print("analysis:", json.dumps({k: v for k, v in res["analysis"].items() if k != "line"}), flush=True)
    if "collection" not in skip:
        res["collection"] = collection(a.nodes, 8)
        print("collection:", json.dumps({k: v for k, v in res["collection"].items() if k != "line"}), flush=True)
    if "sampler" not in skip:
        res["sampler"] = sampler_cost()
        print("sampler:", json.dumps(res["sampler"]), flush=True)
    if "overhead" not in skip:
        sys.path.insert(0, str(REPO))
        from orchestrator.node.hooks.orchestrate_hangs import ARRIVAL_S
        blocks = blocks_in_a_run(64, a.block, a.blocks, a.block_runs)
        amplified = blocks_in_a_run(64, a.block, a.blocks, a.block_runs, every=ARRIVAL_S / 20)
        rec = recorder_cost(a.record_rounds, 20000)
        share = rec["orchestrate_minus_off_us"]["median"] * blocks["collectives_per_step"] / (blocks["step_ms"] * 1000)
        res["overhead"] = {"sampler_blocks": blocks, "sampler_blocks_x20": amplified,
                           "sampler_estimate_at_2s": {"from_median": round(amplified["median_rel"] / 20, 4),
                                                      "from_mean": round(amplified["mean_rel"] / 20, 4)},
                           "recorder": rec, "recorder_share_of_step": round(share, 4)}
        print("overhead:", json.dumps(res["overhead"]), flush=True)
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

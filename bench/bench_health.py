#!/usr/bin/env python3
"""Health monitoring benchmark (not CI), local backend, 2 emulated nodes, median of N:

- hang: one rank SIGSTOPped -> the monitor decides (stacks written) and -> every process gone, with
  `health.stall_timeout` S (the detection floor is S; what matters is the latency above it);
- dead rank: one rank SIGKILLed -> job FAILED returned and -> every process gone;
- monitoring overhead: the tiny SFT recipe's train_runtime with heartbeats on vs off (same process count).

    python bench/bench_health.py [--repeat 5] [--stall 3] [--steps 200] [--only faults|overhead]

Writes bench/results/health.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "launchers"))
sys.path.insert(0, str(REPO / "tests"))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

from test_local import job_pids, probe_prepared, wait_gone  # noqa: E402  (the suite's probe job)

from launchers.local import LocalLauncher  # noqa: E402
from orchestrator.node.rundir import RunDir  # noqa: E402
from orchestrator.supervise import Supervisor  # noqa: E402
from orchestrator import api  # noqa: E402


def started(run_dir: Path, out: Path) -> None:
    deadline = time.monotonic() + 120
    hb = run_dir / "heartbeats" / "rank1.jsonl"
    while not (hb.exists() and hb.stat().st_size > 500 and (out / "pid1").exists()):
        if time.monotonic() > deadline:
            raise RuntimeError("probe did not start")
        time.sleep(0.05)


def one(tmp: Path, i: int, sig: int, stall: float) -> dict:
    d = tmp / f"{int(sig)}-{i}"
    d.mkdir(parents=True)
    prep, out = probe_prepared(d, 2, 1, "loop", stall=stall)
    launcher = LocalLauncher(grace=2)
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    job = launcher.submit(launcher.prepare(prep.plan), RunDir(run_dir))
    started(run_dir, out)
    pids = job_pids(prep.plan, out)
    victim = int((out / "pid1").read_text())
    t0_wall, t0 = time.time(), time.monotonic()
    os.kill(victim, sig)
    res = Supervisor(prep.plan).run(job)
    returned = time.monotonic() - t0
    gone = wait_gone(pids, 30) + returned
    r = {"state": res.state, "returned_s": returned, "all_gone_s": gone}
    if sig == signal.SIGSTOP:
        r["decided_s"] = (run_dir / "stacks").stat().st_mtime - t0_wall
        assert res.hung and "is stopped" in res.root_cause, res.root_cause
    return r


def overhead(tmp: Path, on: bool, i: int, steps: int) -> float:
    cfg = tmp / f"over-{on}-{i}.yaml"
    import yaml
    recipe = yaml.safe_load((REPO / "recipes/configs/sft_tiny.yaml").read_text())
    recipe["trainer"].update(max_steps=steps, logging_steps=1, output_dir=str(tmp / f"o-{on}-{i}"))
    recipe["data"]["path"] = str(REPO / recipe["data"]["path"])
    recipe["checkpoint"]["resume"] = "never"
    cfg.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, ORCHESTRATE_ACCELERATOR="cpu")
    env.pop("ORCHESTRATE_HEARTBEAT_DIR", None)
    if on:
        env["ORCHESTRATE_HEARTBEAT_DIR"] = str(tmp / f"hb-{i}")
    r = subprocess.run([sys.executable, "-m", "recipes.run", str(cfg)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    line = next(x for x in r.stdout.splitlines() if x.startswith("ORCHESTRATE_RESULT "))
    return float(json.loads(line.split(" ", 1)[1])["train_runtime"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stall", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=200, help="steps per overhead run (longer: less noise)")
    ap.add_argument("--only", choices=("faults", "overhead"), default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-health-"))
    os.environ["ORCHESTRATE_HOME"] = str(tmp / "home")
    med = statistics.median
    result: dict = {"repeat": args.repeat}
    if args.only != "overhead":
        hangs = [one(tmp, i, signal.SIGSTOP, args.stall) for i in range(args.repeat)]
        kills = [one(tmp, i, signal.SIGKILL, 60) for i in range(args.repeat)]
        result.update({
            "stall_timeout_s": args.stall,
            "hang_decided_s": round(med(h["decided_s"] for h in hangs), 3),
            "hang_all_gone_s": round(med(h["all_gone_s"] for h in hangs), 3),
            "dead_rank_failed_s": round(med(k["returned_s"] for k in kills), 3),
            "dead_rank_all_gone_s": round(med(k["all_gone_s"] for k in kills), 3),
            "fault_runs": {"hangs": hangs, "kills": kills}})
        print(f"hang (SIGSTOP, stall_timeout {args.stall:g}s), median of {args.repeat}: decided after "
              f"{result['hang_decided_s']:.2f}s, every process gone after {result['hang_all_gone_s']:.2f}s")
        print(f"dead rank (SIGKILL): job FAILED after {result['dead_rank_failed_s']:.2f}s, every process gone "
              f"after {result['dead_rank_all_gone_s']:.2f}s")
    if args.only != "faults":
        runs = {True: [], False: []}
        for i in range(args.repeat):  # interleaved pairs: drift hits both alike
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                runs[on].append(overhead(tmp, on, i, args.steps))
        pairs = [a / b - 1 for a, b in zip(runs[True], runs[False], strict=False)]
        result.update({
            "steps": args.steps,
            "train_runtime_heartbeats_on_s": round(med(runs[True]), 3),
            "train_runtime_heartbeats_off_s": round(med(runs[False]), 3),
            "heartbeat_overhead_pct": round(100 * (med(runs[True]) / med(runs[False]) - 1), 2),
            "heartbeat_overhead_pct_median_of_pairs": round(100 * med(pairs), 2),
            "overhead_runs": {"on": runs[True], "off": runs[False]}})
        print(f"heartbeats on/off, train_runtime of {args.steps} steps (median of {args.repeat}): "
              f"{result['train_runtime_heartbeats_on_s']:.2f}s / {result['train_runtime_heartbeats_off_s']:.2f}s "
              f"({result['heartbeat_overhead_pct']:+.2f}%; median of paired runs "
              f"{result['heartbeat_overhead_pct_median_of_pairs']:+.2f}%)")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / ("health.json" if not args.only else f"health-{args.only}.json")).write_text(
        json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

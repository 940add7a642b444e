#!/usr/bin/env python3
"""Health monitoring benchmark (not CI), local backend, 2 emulated nodes, median of N:

- hang: one rank SIGSTOPped -> the monitor decides (stacks written) and -> every process gone, with
  `health.stall_timeout` S (the detection floor is S; what matters is the latency above it);
- dead rank: one rank SIGKILLed -> job FAILED returned and -> every process gone;
- monitoring overhead: the tiny SFT recipe's train_runtime with heartbeats on vs off (same process count).

    python bench/bench_health.py [--repeat 5] [--stall 3]

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
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

from test_local import job_pids, probe_prepared, wait_gone  # noqa: E402  (the suite's probe job)

from launchers.local import LocalLauncher  # noqa: E402
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
    handle = launcher.submit(launcher.prepare(prep.plan))
    started(run_dir, out)
    pids = job_pids(prep.plan, out)
    victim = int((out / "pid1").read_text())
    t0_wall, t0 = time.time(), time.monotonic()
    os.kill(victim, sig)
    res = launcher.wait(handle)
    returned = time.monotonic() - t0
    gone = wait_gone(pids, 30) + returned
    r = {"state": res.state, "returned_s": returned, "all_gone_s": gone}
    if sig == signal.SIGSTOP:
        r["decided_s"] = (run_dir / "stacks").stat().st_mtime - t0_wall
        assert res.hung and "is stopped" in res.root_cause, res.root_cause
    return r


def overhead(tmp: Path, on: bool, i: int) -> float:
    cfg = tmp / f"over-{on}-{i}.yaml"
    import yaml
    recipe = yaml.safe_load((REPO / "recipes/configs/sft_tiny.yaml").read_text())
    recipe["trainer"].update(max_steps=40, logging_steps=1, output_dir=str(tmp / f"o-{on}-{i}"))
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
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-health-"))
    os.environ["ORCHESTRATE_HOME"] = str(tmp / "home")
    hangs = [one(tmp, i, signal.SIGSTOP, args.stall) for i in range(args.repeat)]
    kills = [one(tmp, i, signal.SIGKILL, 60) for i in range(args.repeat)]
    runs = {True: [], False: []}
    for i in range(args.repeat):  # interleaved on/off
        for on in (False, True):
            runs[on].append(overhead(tmp, on, i))
    med = statistics.median
    result = {
        "stall_timeout_s": args.stall,
        "hang_decided_s": round(med(h["decided_s"] for h in hangs), 3),
        "hang_all_gone_s": round(med(h["all_gone_s"] for h in hangs), 3),
        "dead_rank_failed_s": round(med(k["returned_s"] for k in kills), 3),
        "dead_rank_all_gone_s": round(med(k["all_gone_s"] for k in kills), 3),
        "train_runtime_heartbeats_on_s": round(med(runs[True]), 3),
        "train_runtime_heartbeats_off_s": round(med(runs[False]), 3),
        "runs": {"hangs": hangs, "kills": kills, "on": runs[True], "off": runs[False]},
    }
    result["heartbeat_overhead_pct"] = round(100 * (result["train_runtime_heartbeats_on_s"] /
                                                     result["train_runtime_heartbeats_off_s"] - 1), 2)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "health.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"hang (SIGSTOP, stall_timeout {args.stall:g}s), median of {args.repeat}: decided after "
          f"{result['hang_decided_s']:.2f}s, every process gone after {result['hang_all_gone_s']:.2f}s")
    print(f"dead rank (SIGKILL): job FAILED after {result['dead_rank_failed_s']:.2f}s, every process gone after "
          f"{result['dead_rank_all_gone_s']:.2f}s")
    print(f"heartbeats on/off, train_runtime of 40 steps: {result['train_runtime_heartbeats_on_s']:.2f}s / "
          f"{result['train_runtime_heartbeats_off_s']:.2f}s ({result['heartbeat_overhead_pct']:+.2f}%; noise on a "
          "2-core machine is larger than the effect: the recipe's self-timing is the precise number)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

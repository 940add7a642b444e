#!/usr/bin/env python3
"""Goodput on a faulty fleet (issue #26; not CI): a 2-node tiny SFT job whose host b crashes on every attempt (its rank
SIGKILLed a few steps in, each time, by the test harness: tests/badnodes.HostKiller), submitted to
- "spares": 3 sshd hosts listed (a, b, c): the restart policy takes b out after its second crash and the job resumes
  on a and c from the last checkpoint;
- "same hosts": only a and b listed: the policy knows b is bad after its second crash and, with no spare to take its
  place, stops at once (FAILED, saying no spare is left) instead of spending the rest of the budget;
- "today" (with --old REV, e.g. the commit before bad-node handling): orchestrate as it was, a and b listed: every
  restart lands on b again until the budget (health.max_restarts: 3) is spent, and the job FAILS.
Interleaved rounds; per side: the end state, the time from submit to the end, the training steps done in the end.

    python bench/bench_spares.py [--rounds 3] [--steps 40] [--old e68d775]

Results: bench/results/spares.json. Needs root (sshd hosts on loopback: scripts/sshd_hosts.py).
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
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--base-ip", default="127.0.17.2")
    ap.add_argument("--port", type=int, default=2237)
    ap.add_argument("--old", default=None, help="a git revision: also run the job with orchestrate as it was then")
    args = ap.parse_args()
    import sshd_hosts
    from badnodes import HostKiller
    why = sshd_hosts.prerequisites()
    if why:
        print(f"bench_spares: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-spares-"))
    old_tree = None
    if args.old:  # that revision's orchestrator, run by this venv's python (its PYTHONPATH wins over the install)
        old_tree = tmp / "old"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old_tree), args.old], check=True,
                       capture_output=True)
    tb = sshd_hosts.up(3, tmp / "sshd", base_ip=args.base_ip, port=args.port)
    a, b, c = tb.hosts
    try:
        def run(side: str, i: int) -> dict:
            hosts = [a, b, c] if side == "spares" else [a, b]
            extra = {"PYTHONPATH": str(old_tree)} if side == "today" else {}
            cluster = tmp / f"{side}{i}.yaml"
            cluster.write_text(json.dumps(tb.cluster("bench", hosts=hosts)))
            home = tmp / f"home-{side}{i}"
            killer = HostKiller(home, b, after=5, times=99)
            t0 = time.time()
            p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit",
                                str(REPO / "recipes/configs/sft_tiny.yaml"), "--nodes", "2", "--cluster", str(cluster),
                                f"trainer.max_steps={args.steps}", "trainer.save_strategy=steps",
                                "trainer.save_steps=4", "health.max_restarts=3",
                                f"trainer.output_dir={tmp / f'out-{side}{i}'}"],
                               capture_output=True, text=True, cwd=old_tree if side == "today" else REPO,
                               env={**os.environ, **OFFLINE, "ORCHESTRATE_HOME": str(home), **extra})
            took = time.time() - t0
            killer.stop()
            m = re.search(r"job \S+ (COMPLETED|FAILED)", p.stdout + p.stderr)
            run_dir = next((home / "runs").iterdir())
            from orchestrator.node.rundir import RunDir
            return {"state": m.group(1) if m else f"exit {p.returncode}", "seconds": took, "kills": len(killer.kills),
                    "restarts": RunDir(run_dir).restarts(), "steps": RunDir(run_dir).furthest_step() or 0}
        sides = ["spares", "same_hosts"] + (["today"] if old_tree else [])
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for i in range(args.rounds):
            for side in (sides if i % 2 == 0 else list(reversed(sides))):
                runs[side].append(run(side, i))
            print(f"round {i}: " + "; ".join(f"{s} {r[-1]['state']} in {r[-1]['seconds']:.1f}s "
                                             f"({r[-1]['restarts']} restarts, step {r[-1]['steps']})"
                                             for s, r in runs.items()), flush=True)
        result = {"rounds": args.rounds, "steps": args.steps, "machine": f"{os.cpu_count()} cores",
                  "median_s": {s: statistics.median(x["seconds"] for x in r) for s, r in runs.items()},
                  "states": {s: [x["state"] for x in r] for s, r in runs.items()}, "runs": runs}
        print("to the end, median: " + "; ".join(f"{s} {result['median_s'][s]:.1f}s ({result['states'][s]})"
                                                 for s in sides))
        out = REPO / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "spares.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        sshd_hosts.down(tmp / "sshd")
        if old_tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)],
                           capture_output=True)


if __name__ == "__main__":
    sys.exit(main())

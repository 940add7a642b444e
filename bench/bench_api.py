#!/usr/bin/env python3
"""The Python API's cost (issue #36's benchmark; not CI):

1. `import orchestrator`: wall time of `python -c "import orchestrator"` minus `python -c "pass"` (interleaved,
   median and range), the package's own cumulative time from `python -X importtime`, and the modules it adds.
2. A job through the API against the same job through the CLI, interleaved round by round, each in a fresh
   process from its start: `detached` = until the submit returns with the job recorded RUNNING
   (`orchestrator.submit(...)` vs `orchestrate submit --detach`), `attached` = until the job has ended
   (`orchestrator.submit(..., detach=False)` vs `orchestrate submit`). The job: own code on 2 local nodes whose
   ranks print a line and exit (nothing of training is measured). Same path, so the difference should be noise.

    .venv/bin/python bench/bench_api.py [--repeat 7]

Writes bench/results/api.json.
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
PY = sys.executable


def timed(argv: list[str], env: dict, cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{argv} failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return took, r.stdout


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "n": len(xs)}


def import_cost(repeat: int, env: dict) -> dict:
    bare, pkg, own = [], [], []
    for _ in range(repeat):
        bare.append(timed([PY, "-c", "pass"], env, REPO)[0])
        pkg.append(timed([PY, "-c", "import orchestrator"], env, REPO)[0])
        r = subprocess.run([PY, "-X", "importtime", "-c", "import orchestrator"], env=env, cwd=REPO,
                           capture_output=True, text=True, check=True)
        line = [x for x in r.stderr.splitlines() if x.rstrip().endswith("| orchestrator")][-1]
        own.append(int(line.split("|")[1]) / 1e6)  # cumulative microseconds -> s
    code = ("import sys; before = set(sys.modules); import orchestrator; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    added = subprocess.run([PY, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    return {"python_pass_s": summary(bare), "import_orchestrator_s": summary(pkg),
            "paired_extra_s": summary([p - b for p, b in zip(pkg, bare, strict=True)]),
            "importtime_cumulative_s": summary(own), "modules_added": added}


def submit_cost(repeat: int, env: dict, work: Path) -> dict:
    script = work / "hello.py"
    script.write_text("import os\nprint('HELLO', os.environ['RANK'], flush=True)\n")
    job = work / "job.yaml"
    job.write_text("run: {script: hello.py}\nhealth: {stall_timeout: 120}\n")
    api_detached = ("import orchestrator\nj = orchestrator.submit('job.yaml', nodes=2)\nprint('JOB', j.id, j.state)\n")
    api_attached = ("import orchestrator\nj = orchestrator.submit('job.yaml', nodes=2, detach=False)\n"
                    "print('JOB', j.id, j.state)\n")
    sides = {
        "detached": {"api": [PY, "-c", api_detached],
                     "cli": [PY, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2", "--detach"]},
        "attached": {"api": [PY, "-c", api_attached],
                     "cli": [PY, "-m", "orchestrator.cli", "submit", "job.yaml", "--nodes", "2", "--quiet"]},
    }
    out: dict = {}
    for mode, argvs in sides.items():
        times: dict[str, list[float]] = {"api": [], "cli": []}
        for i in range(repeat + 1):  # the first round warms caches (the trainer field list, the page cache)
            order = ("api", "cli") if i % 2 == 0 else ("cli", "api")  # interleaved, alternating who goes first
            for side in order:
                took, text = timed(argvs[side], env, work)
                if side == "api":
                    assert re.search(r"JOB \S+ (RUNNING|COMPLETED)", text), text
                if i:
                    times[side].append(took)
            if mode == "detached":
                _settle(env, work)
        out[mode] = {"api_s": summary(times["api"]), "cli_s": summary(times["cli"]),
                     "paired_api_minus_cli_s": summary([a - c for a, c in zip(times["api"], times["cli"],
                                                                              strict=True)])}
    return out


def _settle(env: dict, work: Path) -> None:
    """Every detached job of this round ended (they take seconds), so the next round starts on a quiet machine."""
    code = "import orchestrator\nfor j in orchestrator.jobs(None):\n    j.wait(timeout=120)\n"
    subprocess.run([PY, "-c", code], env=env, cwd=work, check=True, timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_api_") as tmp:
        work = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(REPO), "ORCHESTRATE_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        subprocess.run([PY, "-m", "compileall", "-q", str(REPO / "orchestrator"), str(REPO / "launchers")],
                       check=True)
        res = {"when": time.strftime("%Y-%m-%d %H:%M"), "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
               "import": import_cost(args.repeat, env), "submit": submit_cost(args.repeat, env, work)}
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "api.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

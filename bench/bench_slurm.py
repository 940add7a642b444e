"""SLURM backend benchmark (not CI; root; the local cluster must be up: scripts/slurm_cluster.sh up).

    python bench/bench_slurm.py [--repeats 5]

Measures, median of N, on the same 2-node tiny SFT:
  ours:   SlurmLauncher.submit (submitit) -> first training step (heartbeat) and -> COMPLETED
  anchor: a hand-written sbatch + `srun bash -c 'accelerate launch --multi_gpu --machine_rank $SLURM_NODEID ...'`
  rendered: the job.sbatch `orchestrate render` writes, submitted by hand (our agent, no submitit layer)
and the ratio ours/anchor (goal <= 1.0); plus teardown after a SIGKILLed rank, ours and anchor (goal <= 1.5 s):
kill -> job FAILED, -> every process of the job gone (SLURM's own slurmstepd not counted), -> nothing at all
left in the node namespaces (slurmstepd included).

    python bench/bench_slurm.py --only teardown --repeats 3   # one of the two measurements
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "slurm"))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("SLURM_CONF", "/tmp/orchestrate-slurm/etc/slurm.conf")

from slurm_helpers import WORK, heartbeat_step, node_namespace_leftovers, wait_clean  # noqa: E402

from orchestrator.types import JobHandle  # noqa: E402
from launchers.slurm.launcher import SlurmLauncher  # noqa: E402
from orchestrator.node.rundir import RunDir  # noqa: E402
from orchestrator import api  # noqa: E402

ANCHOR = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:10:00
#SBATCH --output={run_dir}/anchor-%j.out
srun bash -c '{py} -m accelerate.commands.launch --multi_gpu --num_machines 2 --num_processes 2 \\
  --machine_rank $SLURM_NODEID --main_process_ip node1 --main_process_port 29511 --rdzv_backend static \\
  -m recipes.run {run_dir}/recipe.yaml'
"""


def idle_cluster(settle: float = 0.5) -> None:
    """Start every run on an idle cluster: no job queued or completing, nothing left in the node namespaces
    (slurmstepd of the previous job included), then a short settle. Without this, a run starts while the previous
    run's step cleanup still holds the nodes, and each contender pays for the one before it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip()
        states = set(subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout.split())
        if not queued and states <= {"idle"} and not wait_clean(timeout=0):
            break
        time.sleep(0.1)
    time.sleep(settle)


def prepare(tag: str, *over: str):
    out = WORK / f"bench-out-{tag}-{time.time_ns()}"
    return api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(REPO / "cluster_configs/slurm_local.yaml"),
                       nodes=2, cwd=REPO, overrides=[f"cluster.slurm.python={sys.executable}",
                                                     f"cluster.slurm.workdir={WORK}", f"trainer.output_dir={out}",
                                                     *over])


def phases(run_dir: Path, t0_wall: float) -> dict[str, float]:
    """When rank 0's process existed, booted, had its process group, began training, stepped and ended (s after
    sbatch)."""
    out: dict[str, float] = {}
    try:
        recs = [json.loads(x) for x in (run_dir / "heartbeats" / "rank0.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return out
    for r in recs:
        if r.get("event") == "boot" and r.get("proc_start"):
            out.setdefault("rank_process", r["proc_start"] - t0_wall)
        if r.get("event") in ("boot", "dist", "start", "step", "end"):
            name = {"start": "train_begin", "step": "first_step", "end": "train_end"}.get(r["event"], r["event"])
            out.setdefault(name,
                           r["t"] - t0_wall)
    return out


def first_step_and_done(L: SlurmLauncher, h: JobHandle, run_dir: Path, t0: float) -> tuple[float, float, dict]:
    t0_wall = time.time() - (time.monotonic() - t0)
    first = None
    while True:
        if first is None and heartbeat_step(run_dir) >= 1:
            first = time.monotonic() - t0
        q = L.query(h)
        if q["terminal"]:
            assert q["state"] == "COMPLETED", q
            done = time.monotonic() - t0
            return first or float("nan"), done, {**phases(run_dir, t0_wall), "completed": done}
        time.sleep(0.05)


def submit_ours(*over: str) -> tuple[SlurmLauncher, JobHandle, Path, float]:
    prep = prepare("ours", *over)
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    L = SlurmLauncher(prep.cluster, poll=0.05)
    sub = L.prepare(prep.plan)
    idle_cluster()
    t0 = time.monotonic()
    return L, L.submit(sub, RunDir(run_dir)).handle, run_dir, t0


def submit_anchor(*over: str) -> tuple[SlurmLauncher, JobHandle, Path, float]:
    prep = prepare("anchor", *over)
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    script = run_dir / "anchor.sbatch"
    script.write_text(ANCHOR.format(run_dir=run_dir, py=sys.executable))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", ORCHESTRATE_HEARTBEAT_DIR=str(run_dir / "heartbeats"),
               ORCHESTRATE_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    idle_cluster()
    t0 = time.monotonic()
    jid = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    L = SlurmLauncher(prep.cluster, poll=0.05)
    return L, JobHandle(f"slurm://{jid}", {"run_dir": str(run_dir)}), run_dir, t0


def submit_rendered(*over: str) -> tuple[SlurmLauncher, JobHandle, Path, float]:
    """The rendered RUN_DIR/job.sbatch (`orchestrate render`), submitted by hand with plain sbatch: no submitit."""
    prep = prepare("rendered", *over)
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    idle_cluster()
    t0 = time.monotonic()
    jid = subprocess.run(["sbatch", "--parsable", str(run_dir / "job.sbatch")], capture_output=True, text=True,
                         check=True).stdout.strip()
    L = SlurmLauncher(prep.cluster, poll=0.05)
    return L, JobHandle(f"slurm://{jid}", {"run_dir": str(run_dir)}), run_dir, t0


def rendered() -> tuple[float, float, dict]:
    L, h, run_dir, t0 = submit_rendered()
    return first_step_and_done(L, h, run_dir, t0)


def ours() -> tuple[float, float, dict]:
    L, h, run_dir, t0 = submit_ours()
    return first_step_and_done(L, h, run_dir, t0)


def anchor() -> tuple[float, float, dict]:
    L, h, run_dir, t0 = submit_anchor()
    return first_step_and_done(L, h, run_dir, t0)


def teardown_after_kill(submit) -> dict[str, float]:
    """SIGKILL node2's rank mid-training -> the job is terminal (FAILED), every process of the job is gone
    (SLURM's own slurmstepd not counted), and nothing at all is left in any node namespace."""
    L, h, run_dir, _ = submit("trainer.max_steps=100000")
    while heartbeat_step(run_dir) < 3:
        time.sleep(0.1)
    pid = None
    for p in subprocess.run(["ip", "netns", "pids", "osl-node2"], capture_output=True, text=True).stdout.split():
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"recipes.run" in cmd and b"accelerate.commands.launch" not in cmd and b"bash" not in cmd:
            pid = int(p)
    assert pid
    t0 = time.monotonic()
    os.kill(pid, 9)
    state = None
    job_gone = None
    last_seen: dict[str, float] = {}  # "ns pid:comm" -> last time seen alive (where the time goes)
    while True:
        left = node_namespace_leftovers()
        now = time.monotonic() - t0
        for ns, procs in left.items():
            for p in procs:
                last_seen[f"{ns[4:]} {p}"] = now
        if job_gone is None and not any(not p.endswith(":slurmstepd") for procs in left.values() for p in procs):
            job_gone = now
        q = L.query(h)
        if q["terminal"] and state is None:
            state = (q["state"], time.monotonic() - t0)
        if state and not left:
            break
        time.sleep(0.05)
    gone = time.monotonic() - t0
    slow = sorted(last_seen.items(), key=lambda kv: kv[1])[-4:]
    print(f"  teardown ({submit.__name__}): {state[0]} after {state[1]:.2f}s, nothing left after {gone:.2f}s; "
          f"last seen: " + ", ".join(f"{k} {v:.2f}" for k, v in slow), flush=True)
    assert state[0] == "FAILED", state
    return {"failed_s": state[1], "job_processes_gone_s": job_gone, "all_gone_s": gone}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("launch", "teardown"), default=None, help="run one of the two measurements")
    args = ap.parse_args()
    report: dict = {"repeats": args.repeats}
    if args.only != "teardown":
        rows = {"ours": [], "anchor": [], "rendered": []}
        for _ in range(args.repeats):  # interleaved, so drift on the machine hits all three alike
            rows["ours"].append(ours())
            rows["anchor"].append(anchor())
            rows["rendered"].append(rendered())
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in rows.items()}
        report["phases_median_s_after_sbatch"] = {
            k: {p: round(statistics.median(x[2][p] for x in v if p in x[2]), 3) for p in v[0][2]}
            for k, v in rows.items()}
        report.update({"ours_first_step_s": med["ours"][0], "ours_completed_s": med["ours"][1],
                       "anchor_first_step_s": med["anchor"][0], "anchor_completed_s": med["anchor"][1],
                       "ratio_first_step": med["ours"][0] / med["anchor"][0],
                       "ratio_completed": med["ours"][1] / med["anchor"][1],
                       "rendered_first_step_s": med["rendered"][0], "rendered_completed_s": med["rendered"][1],
                       "rendered_ratio_first_step": med["rendered"][0] / med["anchor"][0],
                       "rendered_ratio_completed": med["rendered"][1] / med["anchor"][1],
                       # paired: each run against the anchor run right after it (drift cancels)
                       "paired_ratio_first_step_median": statistics.median(
                           o[0] / a[0] for o, a in zip(rows["ours"], rows["anchor"], strict=False)),
                       "paired_ratio_completed_median": statistics.median(
                           o[1] / a[1] for o, a in zip(rows["ours"], rows["anchor"], strict=False)),
                       "paired_ratio_first_step_range": [round(f(o[0] / a[0] for o, a in zip(
                           rows["ours"], rows["anchor"], strict=False)), 3) for f in (min, max)],
                       "paired_ratio_completed_range": [round(f(o[1] / a[1] for o, a in zip(
                           rows["ours"], rows["anchor"], strict=False)), 3) for f in (min, max)]})
        report["runs"] = {k: [[round(x[0], 3), round(x[1], 3)] for x in v] for k, v in rows.items()}
    if args.only != "launch":
        kills = {"ours": [], "anchor": []}
        for _ in range(args.repeats):  # interleaved
            kills["ours"].append(teardown_after_kill(submit_ours))
            kills["anchor"].append(teardown_after_kill(submit_anchor))
        for what in ("failed_s", "job_processes_gone_s", "all_gone_s"):
            med = {k: statistics.median(r[what] for r in v) for k, v in kills.items()}
            report[f"teardown_{what}"] = {**med, "ratio": med["ours"] / med["anchor"]}
        report["teardown_runs"] = kills
    print(json.dumps(report, indent=2))
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    name = "bench_slurm.json" if not args.only else f"bench_slurm-{args.only}.json"
    (out / name).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Queue throughput (issue #27; not CI; a small size runs in tests/gpu/test_local_gpu_leases.py): `--jobs` short jobs
that each need the same hosts / GPUs, submitted at once into one store, run one after another through the queue
(leases, QUEUED, the store's wake-up), against the same jobs run one after another by hand (each `orchestrate
submit` started when the previous one returned), interleaved rounds.

Backends:
- local (default): 2 emulated nodes on this machine, each with a GPU of its own (a stand-in nvidia-smi showing 2
  GPUs: tests/fakes/nvidia-smi); every job takes both, so they queue on the GPU leases;
- ssh: 2 loopback sshd hosts (scripts/sshd_hosts.py, needs root), a CPU cluster (`accelerator: cpu`: the hosts
  have no GPUs); every job takes both hosts, so they queue on the host leases.

Each job is own code (tests/faults/beat_loop.py, `--steps` steps of 0.05 s) under `accelerate launch`. Reported per
round: the wall time of all jobs through the queue and by hand, and the idle gaps between a job's end and the next
one's first process against the previous job's last nodes/<r>/exit.json time: the median and the largest (goal:
<= 0.5 s). The first process: local, the node agent (nodes/<r>/agent.json agent_proc_start; it takes the lease as it
starts); ssh, the launch (proc_start): there the agent is the host's staging session turned agent, started before its
pre-flight takes the lease, so a queued job's staging overlaps the job before it and its agent start says nothing
of when the hosts were free.

    .venv/bin/python bench/bench_queue.py [--jobs 20] [--rounds 2] [--backend local|ssh]

Writes bench/results/queue_<backend>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def job_yaml(path: Path, steps: int, nodes: int = 2) -> Path:
    path.write_text(json.dumps({"run": {"script": str(REPO / "tests" / "faults" / "beat_loop.py"),
                                        "args": [str(steps)]},
                                "launch": {"nodes": nodes, "procs_per_node": 1, "allow_idle_gpus": True},
                                "health": {"preflight_timeout": 0}}))
    return path


def gaps(home: Path, first: str = "agent_proc_start") -> list[float]:
    """Idle seconds between each job's end (its last node's exit record) and the next job's first process (`first`
    of its nodes' agent.json: agent_proc_start, the node agent; proc_start, the launch), in the order the jobs ran."""
    spans = []
    for run in (home / "runs").iterdir():
        starts, ends = [], []
        for node in (run / "nodes").iterdir() if (run / "nodes").is_dir() else []:
            try:
                agent = json.loads((node / "agent.json").read_text())
                ends.append(json.loads((node / "exit.json").read_text())["time"])
            except (OSError, ValueError, KeyError):
                continue
            starts.append(agent.get(first) or agent["started"])
        if starts and ends:
            spans.append((min(starts), max(ends)))
    spans.sort()
    return [round(b[0] - a[1], 3) for a, b in zip(spans, spans[1:], strict=False)]


def run_round(n: int, steps: int, env: dict, work: Path, extra: list[str], nodes: int = 2,
              first: str = "agent_proc_start") -> dict:
    out: dict = {}
    for side in ("queue", "hand"):
        home = work / f"home-{side}"
        shutil.rmtree(home, ignore_errors=True)
        e = dict(env, ORCHESTRATE_HOME=str(home))
        job = job_yaml(work / "job.yaml", steps, nodes)
        argv = [sys.executable, "-m", "orchestrator.cli", "submit", str(job), *extra]
        t0 = time.perf_counter()
        if side == "queue":
            procs = []
            for _ in range(n):
                procs.append(subprocess.Popen(argv, env=e, cwd=REPO, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL))
                time.sleep(0.05)  # submitted in this order (FIFO)
            codes = [p.wait(timeout=600) for p in procs]
        else:
            codes = [subprocess.run(argv, env=e, cwd=REPO, capture_output=True, timeout=600).returncode
                     for _ in range(n)]
        wall = time.perf_counter() - t0
        g = gaps(home, first)
        out[side] = {"wall_s": round(wall, 2), "exit_codes": sorted(set(codes)), "gap_median_s":
                     round(statistics.median(g), 3) if g else None, "gap_max_s": max(g) if g else None, "gaps_s": g}
        print(f"  {side}: {n} jobs in {wall:.1f} s, gaps median {out[side]['gap_median_s']} s, max "
              f"{out[side]['gap_max_s']} s, exit codes {out[side]['exit_codes']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", choices=("local", "ssh"), default="local")
    ap.add_argument("--nodes", type=int, default=2, help="nodes per job (each needs them all)")
    ap.add_argument("--real-gpus", action="store_true", help="local: this machine's own GPUs and nvidia-smi (one "
                    "per node), not the stand-in")
    ap.add_argument("--out", default=None, help="results file (default bench/results/queue_<backend>.json)")
    args = ap.parse_args()
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                                              os.environ.get("PYTHONPATH"))))}
    rounds = []
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-queue-") as tmp:
        work = Path(tmp)
        env["ORCHESTRATE_LEASE_DIR"] = str(work / "leases")
        extra: list[str] = []
        testbed = None
        if args.backend == "local":
            if not args.real_gpus:
                env.update(ORCHESTRATE_NVIDIA_SMI=str(REPO / "tests" / "fakes" / "nvidia-smi"), FAKE_NVIDIA_GPUS="2")
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            sys.path.insert(0, str(REPO / "scripts"))
            import sshd_hosts
            testbed = sshd_hosts.up(2, work / "sshd")
            cluster = work / "cluster.yaml"
            # the loopback hosts have no GPUs: a CPU cluster (one gloo process per node), as tests/ssh run on them
            cluster.write_text(json.dumps(testbed.cluster(name="bench")))
            # every job the same main port, as jobs that leave launch.port alone share 29500; one free here, since
            # all loopback hosts are this machine, where 29500 may be another job's rendezvous
            from orchestrator.api import free_port
            extra = ["--cluster", str(cluster), f"launch.port={free_port()}"]
        try:
            for r in range(args.rounds):
                print(f"round {r + 1}/{args.rounds}", flush=True)
                rounds.append(run_round(args.jobs, args.steps, env, work, extra, args.nodes,
                                        "agent_proc_start" if args.backend == "local" else "proc_start"))
        finally:
            if testbed is not None:
                sshd_hosts.down(work / "sshd")
    q = [r["queue"]["wall_s"] for r in rounds]
    h = [r["hand"]["wall_s"] for r in rounds]
    allgaps = [g for r in rounds for g in r["queue"]["gaps_s"]]
    summary = {"jobs": args.jobs, "steps": args.steps, "backend": args.backend, "nodes": args.nodes,
               "gpus": "real" if args.real_gpus else "stand-in nvidia-smi" if args.backend == "local" else None,
               "first_process": "node agent" if args.backend == "local" else "launch",
               "when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
               "loadavg_1m_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)], "rounds": rounds,
               "queue_wall_median_s": statistics.median(q), "hand_wall_median_s": statistics.median(h),
               "queue_gap_median_s": statistics.median(allgaps) if allgaps else None,
               "queue_gap_max_s": max(allgaps) if allgaps else None,
               "hand_gap_median_s": statistics.median([g for r in rounds for g in r["hand"]["gaps_s"]] or [0])}
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"queue_{args.backend}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The dashboard's server time against store size and ranks (issue #35; tests/web/test_dashboard_http.py runs the
2,000-job / 1,024 x 8 point of it in CI).

A synthetic store as the CLI would find it: `--jobs` finished jobs (real JobStore records), one N x R-rank RUNNING job
(bench_status_scale.make_job: the real planner's plan, the RunDir writers, heartbeats in the hooks' format, a live
supervisor pid file), a 2-node job rendered with a secret in its environment (HF_TOKEN, launch.secret_env), a QUEUED
job with the holder of the lease it waits for. `orchestrate dashboard --port 0` serves it in a process of its own; each
page is fetched `--repeat` times, interleaved, and its server time read from the Server-Timing header (the app's time
to the response's start; the body follows at once). A page is answered from a snapshot at most a second or
two old (web.data.Snapshots); what reading them afresh costs is measured apart (`snapshots_afresh`).

    .venv/bin/python bench/bench_dashboard.py [--jobs 100,2000,10000] [--sizes 8x8,256x8,1024x8] [--repeat 7]
    .venv/bin/python bench/bench_dashboard.py --soak 60     # the server's memory over an hour of a live job

Writes bench/results/dashboard.json (dashboard_soak.json).
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
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_status_scale  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SECRET_JOB_YAML = """run:
  script: %s
launch: {procs_per_node: 2, secret_env: [%s]}
"""


def make_store(home: Path, work: Path, jobs: int, nodes: int, ranks: int, secret_env: str = "HF_TOKEN",
               steps: int = 60) -> dict:
    """The synthetic store of the module docstring; returns the ids (big, secret_job, queued, holder) and the secret
    job's run dir."""
    from orchestrator.node.rundir import RunDir
    from orchestrator.store import JobStore
    big = bench_status_scale.make_job(home, work, nodes, ranks, steps=steps, log_lines=50, state="RUNNING")
    rd = RunDir(home / "runs" / big)
    lines = (rd.heartbeats / "rank5000.jsonl").read_text().splitlines() if nodes * ranks > 5000 else []
    if lines:  # one rank behind: the notable ranks name it
        (rd.heartbeats / "rank5000.jsonl").write_text("\n".join(lines[:steps // 2]) + "\n")
    store = JobStore(home / "jobs.db")
    t0 = time.time() - 86400
    for i in range(jobs):
        job = f"job-{i:05d}"
        store.create(job_id=job, recipe="recipes/configs/sft_tiny.yaml", recipe_digest="0" * 16,
                     cluster=("lab", "local", "slurm-site")[i % 3], backend=("ssh", "local", "slurm")[i % 3],
                     nodes=1 + i % 4, world_size=(1 + i % 4) * 2, run_dir=str(home / "runs" / job),
                     state=("COMPLETED", "FAILED", "CANCELLED")[i % 3])
    # a 2-node job with a secret in its environment, rendered by the real planner
    sw = work / "secret"
    sw.mkdir()
    (sw / "train.py").write_text("print('hi')\n")
    (sw / "job.yaml").write_text(SECRET_JOB_YAML % (sw / "train.py", secret_env))
    secret_job = "secret-job"
    srd = home / "runs" / secret_job
    bench_status_scale.cli(home, "render", str(sw / "job.yaml"), "--nodes", "2", "--out", str(srd))
    store.create(job_id=secret_job, recipe=str(sw / "job.yaml"), recipe_digest="1" * 16, cluster="local",
                 backend="local", nodes=2, world_size=4, run_dir=str(srd))
    store.update(secret_job, "RUNNING", detail="running")
    store.update(secret_job, "COMPLETED", detail="done", exit_code=0, final=True)
    r = RunDir(srd)
    r.mkdir(RunDir.HEARTBEATS)
    r.mkdir(RunDir.LOGS)
    for g in range(4):
        with open(r.heartbeats / f"rank{g}.jsonl", "w") as f:
            for s in range(1, 11):
                f.write(json.dumps({"t": t0 + s, "rank": g, "host": "localhost", "step": s, "max_steps": 10,
                                    "loss": 2.0 / s, "tokens": s * 512, "event": "step"}) + "\n")
    for n in range(2):
        r.log(n).write_text("".join(f"[rank{2 * n + i % 2}]: hello from the job, line {i}\n" for i in range(20)))
    # a QUEUED job and the job that holds its lease
    queued, holder = "queued-job", "holder-job"
    for job, state in ((holder, "RUNNING"), (queued, "QUEUED")):
        store.create(job_id=job, recipe=str(sw / "job.yaml"), recipe_digest="2" * 16, cluster="lab", backend="ssh",
                     nodes=2, world_size=4, run_dir=str(home / "runs" / job), state=state)
    RunDir(home / "runs" / queued).write_json(RunDir.QUEUE, {
        "waiting_for": f"GPU 0 of gpu01 is leased by job {holder}", "since": time.time() - 90, "t": time.time(),
        "busy": [{"host": "gpu01", "what": "GPU 0 of gpu01", "holder": {"job": holder, "submitter": "alice@submit-host",
                                                                      "pid": 4242, "since": time.time() - 300}}]})
    return {"big": big, "secret_job": secret_job, "secret_run_dir": str(srd), "queued": queued, "holder": holder}


def start(home: Path, host: str = "127.0.0.1", env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    """`orchestrate dashboard --port 0 --host H` on `home`, as a user starts it: (process, base URL, token) from the
    line it prints first. Its output goes to HOME/dashboard-<pid>.log (a pipe nobody reads could fill and stop it)."""
    out = home / f"dashboard-{os.getpid()}-{time.monotonic_ns()}.log"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "dashboard", "--port", "0", "--host", host],
                                cwd=REPO, env={**os.environ, **OFFLINE, "ORCHESTRATE_HOME": str(home),
                                               "PYTHONPATH": str(REPO), **(env or {})},
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.match(r"orchestrate dashboard: (http://\S+?)/\?token=(\S+)\n", out.read_text())
        if m:
            return proc, m.group(1), m.group(2)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise AssertionError(f"the dashboard did not start: {out.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def fetch(url: str) -> tuple[float, float, int]:
    """(server time from Server-Timing, wall time to the last byte, bytes)."""
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
        timing = r.headers.get("server-timing", "")
    wall = time.perf_counter() - t
    m = re.search(r"dur=([\d.]+)", timing)
    return (float(m.group(1)) / 1000 if m else wall), wall, len(body)


def time_pages(base: str, pages: list[tuple[str, str]], repeat: int = 5) -> dict[str, dict]:
    """{name: {median_s, range_s, wall_median_s, bytes}} of each page, fetched `repeat` times interleaved (one
    warm-up fetch first)."""
    got: dict[str, list[tuple[float, float, int]]] = {name: [] for _, name in pages}
    for path, _ in pages:
        fetch(base + path)
    for _ in range(repeat):
        for path, name in pages:
            got[name].append(fetch(base + path))
    return {name: {"median_s": round(statistics.median(v[0] for v in vals), 4),
                   "range_s": [round(min(v[0] for v in vals), 4), round(max(v[0] for v in vals), 4)],
                   "wall_median_s": round(statistics.median(v[1] for v in vals), 4), "bytes": vals[-1][2]}
            for name, vals in got.items()}


def snapshot_cost(home: Path, job: str, repeat: int) -> dict:
    """What the pages' snapshots cost when read afresh, as the server's background refresh reads them about once a
    second (web.data.Snapshots): the job page's (views.job_status and its rank rows, the plan), the jobs page's, the
    queue's; in this process, the cache emptied each time."""
    os.environ["ORCHESTRATE_HOME"] = str(home)
    from orchestrator.web import data
    out = {}
    for name, fn in (("job page", lambda: data.job(job)), ("jobs page", data.jobs), ("queue page", data.queue)):
        got = []
        for _ in range(repeat):
            data.SNAPSHOTS.cache.clear()
            t = time.perf_counter()
            fn()
            got.append(time.perf_counter() - t)
        out[name] = {"median_s": round(statistics.median(got), 4), "range_s": [round(min(got), 4),
                                                                                round(max(got), 4)]}
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def soak(minutes: float, out: str) -> None:
    """The server's memory while a live job runs and a page watches it: an 8-rank job (bench_status_scale's) whose
    every rank gains a heartbeat and a log line every 0.5 s (this process writes them, as the ranks would), and a
    client that asks what the job page asks every second (its live part, the series and the log since the last
    look). The server's RSS each minute."""
    import threading
    with tempfile.TemporaryDirectory(prefix="dash-soak-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        made = make_store(home, work, 100, 1, 8)
        job, rd = made["big"], home / "runs" / made["big"]
        stop_writing = threading.Event()

        def writer() -> None:
            step = 61
            while not stop_writing.wait(0.5):
                for g in range(8):
                    with open(rd / "heartbeats" / f"rank{g}.jsonl", "a") as f:
                        f.write(json.dumps({"t": time.time(), "rank": g, "host": "10.77.0.1", "step": step,
                                            "max_steps": 10 ** 6, "loss": 3.0 / step ** 0.3, "tokens": step * 4096,
                                            "event": "step", "compute_s": 0.1}) + "\n")
                with open(rd / "logs" / "node0.log", "a") as f:
                    f.write(f"[rank{step % 8}]: step {step} loss {3.0 / step ** 0.3:.4f}\n")
                step += 1
        threading.Thread(target=writer, daemon=True).start()
        proc, base, _ = start(home)
        samples = []
        try:
            series = json.loads(urllib.request.urlopen(f"{base}/api/jobs/{job}/series", timeout=60).read())
            off = {r: v["offset"] for r, v in series["ranks"].items()}
            logs = json.loads(urllib.request.urlopen(f"{base}/api/jobs/{job}/log", timeout=60).read())["offsets"]
            t0 = time.monotonic()
            next_sample = t0
            while time.monotonic() - t0 < minutes * 60:
                fetch(f"{base}/jobs/{job}?part=1")
                got = json.loads(urllib.request.urlopen(f"{base}/api/jobs/{job}/series?off=" + ",".join(
                    f"{r}:{o}" for r, o in off.items()), timeout=60).read())
                off = {r: v["offset"] for r, v in got["ranks"].items()}
                lg = json.loads(urllib.request.urlopen(f"{base}/api/jobs/{job}/log?off=" + ",".join(
                    f"{n}:{o}" for n, o in logs.items()), timeout=60).read())
                logs = lg["offsets"]
                if time.monotonic() >= next_sample:
                    samples.append({"minute": round((time.monotonic() - t0) / 60, 1), "rss_kib": rss_kib(proc.pid)})
                    print(json.dumps(samples[-1]), flush=True)
                    next_sample += 60
                time.sleep(1.0)
            samples.append({"minute": round((time.monotonic() - t0) / 60, 1), "rss_kib": rss_kib(proc.pid)})
        finally:
            stop_writing.set()
            stop(proc)
    Path(out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "minutes": minutes,
                                     "samples": samples}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="100,2000,10000", help="finished jobs in the store")
    ap.add_argument("--sizes", default="8x8,256x8,1024x8", help="the big job's nodes x ranks")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "dashboard.json"))
    ap.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                    help="instead: the server's memory while a live 8-rank job is watched for MINUTES")
    args = ap.parse_args()
    if args.soak is not None:
        soak(args.soak, str(REPO / "bench" / "results" / "dashboard_soak.json"))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="dash-bench-") as tmp:
        for n_jobs, size in zip(args.jobs.split(","), args.sizes.split(","), strict=True):
            nodes, ranks = (int(x) for x in size.split("x"))
            home, work = Path(tmp) / f"home-{n_jobs}-{size}", Path(tmp) / f"work-{n_jobs}-{size}"
            home.mkdir()
            work.mkdir()
            made = make_store(home, work, int(n_jobs), nodes, ranks)
            proc, base, _ = start(home)
            try:
                big = made["big"]
                times = time_pages(base, [("/", "jobs page"), ("/?part=1", "jobs live part"),
                                          (f"/jobs/{big}", "job page"), (f"/jobs/{big}?part=1", "job live part"),
                                          (f"/api/jobs/{big}/series", "job series"),
                                          (f"/api/jobs/{big}/log", "job log"), ("/queue", "queue page")],
                                   args.repeat)
                row = {"jobs": int(n_jobs) + 4, "nodes": nodes, "ranks_per_node": ranks, "ranks": nodes * ranks,
                       "pages": times, "server_rss_kib": rss_kib(proc.pid),
                       "snapshots_afresh": snapshot_cost(home, big, args.repeat)}
            finally:
                stop(proc)
            rows.append(row)
            print(json.dumps(row), flush=True)
    bench_status_scale.write_results(args.out, rows)


if __name__ == "__main__":
    main()

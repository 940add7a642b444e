"""Local GPU jobs lease their GPUs the same way SSH nodes lease hosts (docs/CONTRACT.md "Leases"), with a stand-in
nvidia-smi showing 2 GPUs: GPU 0 leased by another process (another user's job) -> a job that wants GPU 0
(`launch.gpus: [0]`) waits QUEUED naming the GPU and the holder; the holder dies -> the job starts and completes; and
while GPU 0 is leased, a job that may use any GPU gets GPU 1 at once (disjoint GPUs, the same mechanism)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from helpers import OFFLINE_ENV, PYTHON, cli, read_until

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import time\nfrom orchestrator.core.leases import LOCAL_HOST, holder, node_locks\n"
        "from orchestrator.node.lease import take\n"
        "h, _ = take(list(node_locks(LOCAL_HOST, (0,))), holder('j-holder', 'bob@elsewhere', 1, time.time(), ''), "
        "LOCAL_HOST)\nprint(h is not None, flush=True)\ntime.sleep(600)\n")


def _job(tmp_path: Path, name: str, gpus: list[int] | None) -> Path:
    job = tmp_path / f"{name}.yaml"
    launch = {"nodes": 1, "procs_per_node": 1, "allow_idle_gpus": True} | ({"gpus": gpus} if gpus else {})
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests" / "faults" / "beat_loop.py"), "args": ["2"]},
                                   "launch": launch, "health": {"preflight_timeout": 0}}))
    return job


def _spawn(job_guard, job: Path, env: dict) -> subprocess.Popen:
    return job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(job)], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_local_job_waits_for_its_leased_gpu_and_another_gets_the_free_one(fake_local_gpus, tmp_path, job_guard):
    fake_local_gpus(2)
    leases = tmp_path / "leases"
    env = {**os.environ, **OFFLINE_ENV, "ORCHESTRATE_LEASE_DIR": str(leases), "ORCHESTRATE_HOME": str(tmp_path / "h")}
    job_guard.home(tmp_path / "h")
    holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(env, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "True"
        free = cli("submit", _job(tmp_path, "any", None), env=env, cwd=REPO, timeout=120)  # GPU 1 is free: at once
        assert free.returncode == 0 and "CUDA_VISIBLE_DEVICES=1" in (next((tmp_path / "h" / "runs").iterdir())
                                                                     / "nodes" / "0" / "command.txt").read_text()
        busy = cli("submit", _job(tmp_path, "want0", [0]), "--no-wait", env=env, cwd=REPO, timeout=120)
        assert busy.returncode == 75 and "GPU 0 of localhost is leased by job j-holder (bob@elsewhere" in busy.stderr, \
            busy.stdout[-2000:] + busy.stderr[-2000:]
        waiter = _spawn(job_guard, _job(tmp_path, "want0", [0]), env)
        lines = read_until(waiter, "QUEUED")
        assert "GPU 0 of localhost is leased by job j-holder" in lines[-1], "".join(lines)
        # a second waiter, cancelled while QUEUED from another terminal: CANCELLED, nothing started
        other = _spawn(job_guard, _job(tmp_path, "want0b", [0]), env)
        seen = read_until(other, "QUEUED")
        assert "QUEUED (#2 in this store's queue" in seen[-1], "".join(seen)  # behind the first waiter (FIFO)
        job_b = next(ln.split()[1].rstrip(":") for ln in seen if ": run dir " in ln)
        ls = cli("ls", env=env).stdout
        assert any(job_b in ln and "QUEUED #2" in ln for ln in ls.splitlines()), ls
        t0 = time.monotonic()
        assert cli("cancel", job_b, env=env, timeout=60).returncode == 0
        rest = other.communicate(timeout=30)[0]
        assert other.returncode == 130 and time.monotonic() - t0 < 10, "".join(seen) + rest
        run_b = tmp_path / "h" / "runs" / job_b
        assert not (run_b / "nodes" / "0" / "agent.json").exists()  # nothing started
        assert "CANCELLED" in cli("status", job_b, env=env).stdout
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    t0 = time.monotonic()
    out = "".join(lines) + waiter.communicate(timeout=120)[0]
    assert waiter.returncode == 0 and "COMPLETED" in out, out[-3000:]
    print(f"the waiting local job completed {time.monotonic() - t0:.1f} s after its GPU's holder died")


def test_an_agent_that_loses_the_race_sends_the_attempt_back_to_waiting(fake_local_gpus, tmp_path, monkeypatch,
                                                                         job_guard):
    """The launcher's look saw GPU 0 free, but the node agent finds it leased (another submitter took it in between):
    the agent starts nothing (exit 75, `LeaseBusy:`), the attempt is not a failure, the job waits QUEUED and runs once
    the holder is gone."""
    import threading
    from orchestrator import api
    from orchestrator import running
    from orchestrator.node import lease
    from orchestrator.store import JobStore
    fake_local_gpus(2)
    monkeypatch.setenv("ORCHESTRATE_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "h"))
    job_guard.home(tmp_path / "h")
    monkeypatch.setattr(lease, "held", lambda locks, host: None)  # the look misses the holder: the race
    holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    job_guard.proc(holder)
    assert holder.stdout.readline().strip() == "True"
    events: list[tuple[str, dict]] = []

    def on_event(kind: str, data: dict) -> None:
        events.append((kind, data))
        if kind == "queued" and holder.poll() is None:
            threading.Timer(1.0, holder.kill).start()
    prepared = api.prepare(str(_job(tmp_path, "race", [0])), cwd=REPO)
    result = running.submit(prepared, on_event=on_event)
    assert result.state == "COMPLETED", result
    queued = [d for k, d in events if k == "queued"]
    assert queued and "GPU 0 of localhost is leased by job j-holder" in queued[0]["line"], events
    states = [e["state"] for e in JobStore().events(prepared.plan.job_id)]
    assert "QUEUED" in states and "FAILED" not in states, states


def test_jobs_of_one_store_run_through_the_queue_back_to_back(fake_local_gpus, tmp_path, job_guard):
    """Three 2-node jobs that each take both GPUs, submitted at once into one store: they run one after another
    (never two at once: the agents' own start and exit records), all COMPLETED, and each starts as soon as the one
    before it ended (the store's wake-up, not the QUEUE_POLL_S look: bench/bench_queue.py measures 20)."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_queue
    fake_local_gpus(2)
    env = {**os.environ, **OFFLINE_ENV, "ORCHESTRATE_LEASE_DIR": str(tmp_path / "leases"),
           "ORCHESTRATE_HOME": str(tmp_path / "h")}
    job_guard.home(tmp_path / "h")
    job = bench_queue.job_yaml(tmp_path / "job.yaml", 6)
    procs = []
    for _ in range(3):
        procs.append(_spawn(job_guard, job, env))
        time.sleep(0.05)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-1500:] for o in outs)
    gaps = bench_queue.gaps(tmp_path / "h")
    assert len(gaps) == 2 and min(gaps) > 0, gaps  # one at a time
    assert max(gaps) < 2.0, gaps  # QUEUE_POLL_S (3 s) plus a try would be 3-5 s
    print(f"idle gaps between the queued jobs: {gaps} s")


def test_a_queued_sweep_point_ends_at_once_with_its_sigkilled_runner(fake_local_gpus, tmp_path, job_guard):
    """A point QUEUED behind another user's job writes nothing: it must still see its runner's death at once (its
    output pipe's reader gone), end CANCELLED with nothing started, and never launch after the sweep is dead."""
    from orchestrator.store import JobStore
    fake_local_gpus(2)
    env = {**os.environ, **OFFLINE_ENV, "ORCHESTRATE_LEASE_DIR": str(tmp_path / "leases"),
           "ORCHESTRATE_HOME": str(tmp_path / "h")}
    job_guard.home(tmp_path / "h")
    holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(env, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "True"
        job = tmp_path / "point.yaml"  # (a sweep's points need an output dir each: run.args as a mapping)
        job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests" / "faults" / "exit_after_work.py"),
                                               "args": {"output_dir": str(tmp_path / "out")}},
                                       "launch": {"nodes": 1, "procs_per_node": 1, "gpus": [0]}}))
        runner = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(job),
                                  "--sweep", "health.poll_interval=1,2", "--max-parallel", "2"], env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = read_until(runner, "QUEUED")
        lines += read_until(runner, "QUEUED")  # both points wait for GPU 0
        points = [ln.split(" as job ")[1].split()[0] for ln in lines if " as job " in ln]
        assert len(points) == 2 and sum("QUEUED" in ln for ln in lines) == 2, "".join(lines)
        t0 = time.monotonic()
        runner.kill()
        runner.wait()
        store = JobStore(tmp_path / "h" / "jobs.db")
        while time.monotonic() - t0 < 15 and not all(store.get(j).state == "CANCELLED" for j in points):
            time.sleep(0.1)
        took = time.monotonic() - t0
        recs = [store.get(j) for j in points]
        ends = [(r.state, r.root_cause) for r in recs]
        assert [r.state for r in recs] == ["CANCELLED"] * 2 and took < 8, (took, ends)
        assert all("output went away" in r.root_cause for r in recs), [r.root_cause for r in recs]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    time.sleep(2)  # the GPU is free now: nothing of the dead sweep starts on it
    assert not any((tmp_path / "h" / "runs" / j / "nodes" / "0" / "agent.json").exists() for j in points)
    print(f"both QUEUED points CANCELLED {took:.2f} s after SIGKILL of their sweep's runner")

"""The local backend with real `accelerate launch` (torchrun path, gloo on loopback) and a small
distributed probe program: ranks really join one group across emulated nodes, a failing or killed
rank fails the job with the root cause named and leaves no process behind, Ctrl-C does the same."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import api
from orchestrator import running
import jobrun
from orchestrator.core.jobplan import LaunchPlan
from orchestrator.node.proctools import alive, group_members, marked
from orchestrator.core.render import render_files
from helpers import hang_up_cancels, looping_job, read_looping_ranks

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("dist_probe.py")

def recipe_text(stall: float, restarts: int) -> str:
    import yaml
    return yaml.safe_dump({
        "recipe": "sft", "model": {"name_or_path": "tiny-llama"},
        "data": {"path": str(REPO / "recipes" / "data" / "sft_tiny.jsonl")},
        "trainer": {"max_steps": 5, "per_device_train_batch_size": 2},
        "launch": {"secret_env": ["PROBE_TOKEN"]},
        "health": {"stall_timeout": stall, "startup_timeout": 60, "max_restarts": restarts, "poll_interval": 0.5}})


def probe_prepared(tmp_path: Path, nodes: int, ppn: int, mode: str, stall: float = 60,
                   restarts: int = 0) -> tuple[api.Prepared, Path]:
    recipe = tmp_path / "probe.yaml"
    recipe.write_text(recipe_text(stall, restarts))
    out = tmp_path / "probe_out"
    out.mkdir(exist_ok=True)
    prep = api.prepare(str(recipe), nodes=nodes, procs_per_node=ppn, cwd=tmp_path, check_trainer=False)
    plan = prep.plan
    nps = tuple(dataclasses.replace(n, command=n.command[:5] + (str(PROBE), str(out), mode)) for n in plan.node_plans)
    plan = dataclasses.replace(plan, node_plans=nps)
    return dataclasses.replace(prep, plan=plan, files=render_files(plan, prep.recipe.to_dict())), out


def job_pids(plan: LaunchPlan, out: Path) -> list[int]:
    run_dir = Path(plan.run_dir)
    pids = [int(p.read_text()) for p in out.glob("pid*")]
    for r in range(plan.nodes):
        info = json.loads((run_dir / "nodes" / str(r) / "agent.json").read_text())
        pids += [info["pid"], info["agent_pid"]]
        pids += group_members(info["pgid"])
        pids += marked(info["token"])
    return pids


def wait_gone(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(alive(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"still alive after {timeout}s: {[p for p in pids if alive(p)]}")


@pytest.mark.parametrize("nodes,ppn", [(2, 1), (2, 2)])
def test_ranks_join_one_group_across_nodes(tmp_path, nodes, ppn, monkeypatch):
    monkeypatch.setenv("PROBE_TOKEN", "s3cr3t-canary-value")
    prep, out = probe_prepared(tmp_path, nodes, ppn, "once")
    result = running.submit(prep)
    assert result.state == "COMPLETED", result
    world = nodes * ppn
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert {s["world"] for s in seen} == {world}
    assert {s["sum"] for s in seen} == {world * (world + 1) / 2}  # every rank reduced with every other
    assert sorted(int(s["node"]) for s in seen) == sorted(r // ppn for r in range(world))
    assert all(s["secret"] == "s3cr3t-canary-value" for s in seen)
    run_dir = Path(prep.plan.run_dir)
    assert run_dir.stat().st_mode & 0o077 == 0
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert b"s3cr3t-canary-value" not in f.read_bytes(), f
        if f.is_dir() or f.name in ("plan.json", "recipe.yaml", "accelerate.yaml", "command.txt", "agent.json"):
            assert f.stat().st_mode & 0o077 == 0, f"{f} is not owner-only"


def test_failing_rank_fails_job_and_names_it(tmp_path):
    prep, out = probe_prepared(tmp_path, 2, 1, "fail:1")
    t0 = time.monotonic()
    result = running.submit(prep)
    assert result.state == "FAILED"
    assert result.returncode != 0
    assert result.root_cause.startswith("node 1 (localhost) failed"), result.root_cause
    assert "failing on purpose" in result.root_cause or "exit" in result.root_cause
    wait_gone(job_pids(prep.plan, out), 10)
    assert time.monotonic() - t0 < 60


def test_sigkilled_rank_tears_down_every_node(tmp_path):
    prep, out = probe_prepared(tmp_path, 2, 1, "loop")
    from launchers.local import LocalLauncher
    launcher = LocalLauncher()
    api.write_files(prep.files, Path(prep.plan.run_dir))
    job = jobrun.start(launcher, prep.plan)
    deadline = time.monotonic() + 60
    while not all((out / f"rank{r}.json").exists() for r in range(2)):
        assert time.monotonic() < deadline, "probe did not start"
        time.sleep(0.1)
    victim = int((out / "pid1").read_text())
    pids = job_pids(prep.plan, out)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    result = job.result()
    gone = wait_gone(pids, 15) + (time.monotonic() - t0)
    assert result.state == "FAILED"
    assert "SIGKILL" in result.root_cause, result.root_cause
    print(f"SIGKILL of one rank -> every process of the job gone in {gone:.2f}s")
    assert gone < 10


def test_ctrl_c_stops_everything(tmp_path, job_guard):
    prep, out = probe_prepared(tmp_path, 2, 1, "loop")
    script = (f"import sys, dataclasses; sys.path.insert(0, {str(REPO)!r})\n"
              "from orchestrator import running\nfrom orchestrator.core.jobplan import LaunchPlan\n"
              f"import pickle; prep = pickle.load(open({str(tmp_path / 'prep.pkl')!r}, 'rb'))\n"
              "r = running.submit(prep)\nprint('RESULT', r.state, r.returncode, flush=True)\n"
              "sys.exit(r.returncode)\n")
    import pickle
    (tmp_path / "prep.pkl").write_bytes(pickle.dumps(prep))
    proc = job_guard.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=dict(os.environ))  # SIGINT at its default, however pytest was started
    deadline = time.monotonic() + 60
    while not all((out / f"rank{r}.json").exists() for r in range(2)):
        assert time.monotonic() < deadline, "probe did not start"
        time.sleep(0.1)
    pids = job_pids(prep.plan, out)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=30)
    assert "RESULT CANCELLED 130" in stdout, stdout[-2000:]
    assert proc.returncode == 130
    wait_gone(pids, 10)



@pytest.mark.parametrize("how", ["sighup", "output-gone"])
def test_sighup_of_the_submit_cancels_a_local_job(tmp_path, job_guard, how):
    """The submitting terminal hangs up, or the reader of the submit's output goes away (`submit ... | head`): on
    the local backend nothing could run on without the submitter, so the job is cancelled, recorded with the reason,
    every process gone (on SLURM it runs on: tests/slurm)."""
    home = job_guard.home(tmp_path / "home")
    proc = job_guard.spawn([sys.executable, "-m", "orchestrator.cli", "submit", str(looping_job(tmp_path))],
                           env={**os.environ, "ORCHESTRATE_HOME": str(home)}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # SIGHUP at its default: the CLI installs its own
    job, ranks = read_looping_ranks(proc, 1)
    hang_up_cancels(proc, how, home, job)
    wait_gone(ranks, 10)


def test_killed_submitter_leaves_no_orphans(tmp_path, job_guard):
    prep, out = probe_prepared(tmp_path, 2, 1, "loop")
    import pickle
    (tmp_path / "prep.pkl").write_bytes(pickle.dumps(prep))
    script = (f"import sys, pickle; sys.path.insert(0, {str(REPO)!r})\nfrom orchestrator import running\n"
              f"running.submit(pickle.load(open({str(tmp_path / 'prep.pkl')!r}, 'rb')))\n")
    proc = job_guard.spawn([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not all((out / f"rank{r}.json").exists() for r in range(2)):
        assert time.monotonic() < deadline, "probe did not start"
        time.sleep(0.1)
    pids = job_pids(prep.plan, out)
    proc.kill()
    proc.wait()
    gone = wait_gone(pids, 15)
    print(f"submitter SIGKILLed -> job gone in {gone:.2f}s")


@pytest.mark.health
def test_sigstopped_rank_is_detected_as_hang_and_torn_down(tmp_path):
    prep, out = probe_prepared(tmp_path, 2, 1, "loop", stall=3)
    from launchers.local import LocalLauncher
    launcher = LocalLauncher(grace=2)
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    job = jobrun.start(launcher, prep.plan, grace=2)
    deadline = time.monotonic() + 60
    while not (run_dir / "heartbeats" / "rank1.jsonl").exists() or \
            (run_dir / "heartbeats" / "rank1.jsonl").stat().st_size < 200:
        assert time.monotonic() < deadline, "probe did not start"
        time.sleep(0.1)
    victim = int((out / "pid1").read_text())
    pids = job_pids(prep.plan, out)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    result = job.result()
    detected = time.monotonic() - t0
    gone = wait_gone(pids, 15) + detected
    assert result.state == "FAILED" and result.hung
    assert f"rank 1 (process {victim} is stopped)" in result.root_cause, result.root_cause  # (core.hangs)
    stack = (run_dir / "stacks" / "rank1.txt").read_text()
    assert "dist_probe.py" in stack or "Thread" in stack, stack[:500]
    print(f"SIGSTOP -> hang detected and job gone in {gone:.2f}s (stall_timeout 3s)")
    assert detected < 3 + 5


@pytest.mark.health
def test_restart_resumes_and_finishes(tmp_path):
    prep, out = probe_prepared(tmp_path, 2, 1, "fail_until:2", restarts=1)
    result = running.submit(prep)
    assert result.state == "COMPLETED", result.root_cause
    assert result.restarts == 1
    assert (out / "attempts").read_text() == "2"
    from orchestrator.store import JobStore
    rec = JobStore().get(prep.plan.job_id)
    assert rec.restarts == 1 and rec.state == "COMPLETED"
    events = [e["state"] for e in JobStore().events(prep.plan.job_id)]
    assert events.count("RESTARTING") == 1 and events[-1] == "COMPLETED"


@pytest.mark.health
def test_crash_loop_stops(tmp_path):
    prep, out = probe_prepared(tmp_path, 2, 1, "fail_until:100", restarts=5)
    result = running.submit(prep)
    assert result.state == "FAILED"
    assert "crash loop: no progress since the last restart" in result.root_cause, result.root_cause
    assert (out / "attempts").read_text() == "2"  # first try + 1 restart that made no progress
    assert result.restarts == 1

"""Bad hosts out, spares in (issue #26), on real sshd hosts: 3 hosts listed, 2 nodes wanted, so one is a spare.

- A host whose rank dies on every attempt: the first crash is retried on the same hosts, the second on that host takes
  it out; the restart runs on hosts 1 and 3 (new machine ranks, the spare staged), resumes past the checkpoint and
  completes; `status` shows the host excluded and why. On the shared testbed and on hosts that share nothing with the
  submitter (there the spare gets a copy of the newest checkpoint before it resumes).
- Without a spare, the same job ends FAILED saying no spare is left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from badnodes import HostKiller, job_ids
from helpers import cli
from ssh_helpers import REPO

pytestmark = pytest.mark.slow


def _sft(testbed, tmp_path: Path, hosts: list[str], *extra: str):
    cluster = tmp_path / "spares.yaml"
    cluster.write_text(yaml.safe_dump(testbed.cluster("spares", hosts=hosts)))
    home = tmp_path / "home"
    args = ["submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", cluster,
            "trainer.max_steps=40", "trainer.save_strategy=steps", "trainer.save_steps=4", "health.max_restarts=3",
            f"trainer.output_dir={tmp_path / 'out'}", *extra]
    return home, args


def _submit_while(args, home: Path, fault):
    """The CLI's submit of `args` while `fault` (a HostKiller or Throttler) acts; the fault stopped whatever happens."""
    try:
        return cli(*args, env={"ORCHESTRATE_HOME": home}, cwd=REPO, timeout=900)
    finally:
        fault.stop()


@pytest.mark.fault
def test_a_host_that_crashes_every_attempt_is_replaced_by_the_spare(testbed, tmp_path, job_guard):
    a, b, c = testbed.hosts[:3]
    home, args = _sft(testbed, tmp_path, [a, b, c])
    job_guard.home(home)
    killer = HostKiller(home, b, after=10, times=2)  # b's rank: killed 10 steps into attempt 0, 2 into attempt 1
    p = _submit_while(args, home, killer)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "COMPLETED" in p.stdout, out[-4000:]
    assert len(killer.kills) == 2, (killer.kills, killer.seen, out[-4000:])
    job = job_ids(home)[-1]
    run_dir = home / "runs" / job
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [n["host"] for n in plan["node_plans"]] == [a, c], plan["node_plans"]  # the spare took b's place
    after = p.stdout.split("restart 2/", 1)[1]  # the live output labels node 1 with the host that runs it now
    assert f"[{c} node1 rank1]" in after and f"[{b} node1" not in after, after[-3000:]
    attempts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(x["decision"], x["host"], x["kind"], x["exclude"]) for x in attempts] == [
        ("restart", b, "crash", ""), ("restart", b, "crash", b)], attempts
    result = json.loads(next(line for line in reversed(out.splitlines()) if "ORCHESTRATE_RESULT " in line)
                        .split("ORCHESTRATE_RESULT ", 1)[1])
    m = re.search(r"checkpoint-(\d+)", str(result["resumed_from"]))
    assert m and int(m.group(1)) >= 8 and result["global_step"] == 40, result  # past the checkpoint, to the end
    st = json.loads(cli("status", job, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
    assert st["state"] == "COMPLETED" and st["restarts"] == 2, st
    assert list(st["excluded"]) == [b] and "crash, twice in a row" in st["excluded"][b], st["excluded"]
    text = cli("status", job, env={"ORCHESTRATE_HOME": home}).stdout
    assert f"excluded {b}: " in text, text
    # every attempt's cause, and the hosts as the cluster file names them (the testbed hosts are one machine)
    assert [x["attempt"] for x in st["attempts"]] == [0, 1], st["attempts"]
    assert all("SIGKILL" in x["reason"] for x in st["attempts"]) and "attempt  1: node " in text, text
    assert [r["host"] for r in st["ranks"]] == [a, c] and [n["host"] for n in st["nodes"]] == [a, c], st
    if testbed.private:  # the spare had no checkpoint of its own: it got the newest one before it resumed
        staged = json.loads((run_dir / "staged.json").read_text())
        assert list(staged["seeded"]) == [c] and f"from {a}" in staged["seeded"][c], staged["seeded"]


def test_without_a_spare_the_job_fails_saying_so(testbed, tmp_path, job_guard):
    a, b = testbed.hosts[:2]
    home, args = _sft(testbed, tmp_path, [a, b])
    job_guard.home(home)
    killer = HostKiller(home, b, after=10, times=2)
    p = _submit_while(args, home, killer)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"{b} is bad (crash, again) and no spare host is left to replace it" in p.stderr, p.stderr[-3000:]


def test_a_straggler_host_is_replaced_by_the_spare_with_restart_without(testbed, tmp_path, job_guard):
    """Host b's rank made slow but alive (SIGSTOP / SIGCONT, stopped 25 ms of every 30 ms on average): with
    health.straggler.action restart_without the supervisor names it, stops the attempt and the one RestartPolicy takes
    b out at once; the restart runs on a and c (the spare) from the checkpoint and completes."""
    from badnodes import Throttler, ranks_on
    a, b, c = testbed.hosts[:3]
    # (factor 1.8: b's rank runs at about a sixth of its speed, while on this 2-core machine, with other tests' and
    # CI's load, an unthrottled rank's forward can jitter to 1.4x its peer's; launch.env: one thread per rank)
    home, args = _sft(testbed, tmp_path, [a, b, c], "health.straggler.window=10", "health.straggler.factor=1.8",
                      "health.straggler.action=restart_without", "launch.env.OMP_NUM_THREADS=1")
    job_guard.home(home)

    def slow_rank():
        jobs = job_ids(home)
        mine = ranks_on(b, jobs[-1]) if jobs else {}
        return next(iter(mine.values()), None)

    throttle = Throttler(slow_rank, stop_s=0.025, period_s=0.03)
    p = _submit_while(args, home, throttle)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "COMPLETED" in p.stdout, out[-4000:]
    assert "is a straggler: " in out and f" on {b} " in out, out[-4000:]
    run_dir = home / "runs" / job_ids(home)[-1]
    attempts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(x["decision"], x["host"], x["kind"], x["exclude"]) for x in attempts] == [
        ("restart", b, "straggler", b)], attempts
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [n["host"] for n in plan["node_plans"]] == [a, c], plan["node_plans"]
    st = json.loads(cli("status", run_dir.name, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
    assert st["state"] == "COMPLETED" and list(st["excluded"]) == [b], st
    assert [(s["host"], s["action"], s["attempt"]) for s in st["stragglers"]] == [(b, "restart_without", 0)], st


def test_a_refused_job_is_recorded_as_the_submit_says_it(testbed, tmp_path, job_guard):
    """Both hosts fail the pre-flight the same way (the cluster's python is missing: the job's problem, not a host's):
    no spare is named, and the store keeps the very error the submit printed (the same problems, the same count) and
    its exit code 2, not FAILED with no exit code."""
    a, b = testbed.hosts[:2]
    home, args = _sft(testbed, tmp_path, [a, b])
    doc = yaml.safe_load(args[5].read_text())
    doc["ssh"]["python"] = "/nonexistent/python3"
    args[5].write_text(yaml.safe_dump(doc))
    job_guard.home(home)
    p = cli(*args, env={"ORCHESTRATE_HOME": home}, cwd=REPO, timeout=300)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    error = p.stderr.split("orchestrate: error:", 1)[1].strip()
    assert "spare" not in p.stderr and "2 problems" in error, p.stderr
    rec = json.loads(cli("ls", "--json", env={"ORCHESTRATE_HOME": home}).stdout)[0]
    assert rec["state"] == "FAILED" and rec["exit_code"] == 2, rec
    assert rec["root_cause"] == error[:500], (error, rec["root_cause"])

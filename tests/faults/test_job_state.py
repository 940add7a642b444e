"""Job state you can trust (issue #15), on the local backend with real node agents and `accelerate launch`:
cancel works whatever signal dispositions the supervisor inherited and says who cancelled; a supervisor that dies
leaves no job RUNNING in `ls`/`status`; a restart whose start-up is slower than stall_timeout is not a false hang."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PYTHON, cli, wait_gone, wait_until
from orchestrator import api
from orchestrator import running
from orchestrator.core.render import render_files
from orchestrator.node.proctools import marked
from orchestrator.node.rundir import RunDir
from orchestrator.store import JobStore

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("fault_probe.py")


def _long_job_args(tmp_path: Path) -> list[str]:
    return ["recipes/configs/sft_tiny.yaml", "--nodes", "2", "trainer.max_steps=100000",
            f"trainer.output_dir={tmp_path / 'out'}"]


def _job_id(text: str) -> str:
    import re
    m = re.search(r"job (\S+) (?:RUNNING|PENDING)", text) or re.search(r"job (\S+): run dir", text)
    assert m, text
    return m.group(1)


@pytest.mark.health
def test_cancel_reaches_a_background_supervisor_that_ignores_sigint(tmp_path, job_guard):
    """`submit --detach &` from a non-interactive shell: the supervisor inherits SIGINT ignored. cancel still ends
    the job within seconds, records who cancelled it, and nothing is left."""
    script = (f"cd {REPO} && {PYTHON} -m orchestrator.cli submit " + " ".join(_long_job_args(tmp_path))
              + " --detach & wait")
    r = subprocess.run(["bash", "-c", "trap '' INT; " + script], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    job = _job_id(r.stdout)
    rec = JobStore().get(job)
    rd = RunDir(rec.run_dir)
    wait_until(lambda: len(rd.agents()) == 2 and rd.furthest_step(), 180, 0.2, "training to step")
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    t0 = time.monotonic()
    c = cli("cancel", job, timeout=90)
    took = time.monotonic() - t0
    assert c.returncode == 0, c.stdout + c.stderr
    assert "CANCELLED" in c.stdout, c.stdout
    rec = JobStore().get(job)
    assert rec.state == "CANCELLED" and rec.root_cause == "cancelled by the user (orchestrate cancel)", rec
    gone = wait_gone(lambda: [p for t in tokens for p in marked(t)], 20)
    print(f"cancel of a supervisor with SIGINT ignored: CANCELLED after {took:.1f}s, all gone {gone:.2f}s later")
    assert took < 20


@pytest.mark.health
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_dead_supervisor_is_not_running_forever(tmp_path, job_guard, sig):
    """The supervising process dies (SIGKILL) or is terminated: its nodes stop by themselves, and `status` / `ls`
    record the job FAILED (SIGKILL: the supervisor is gone with no node alive) or CANCELLED (SIGTERM: handled)."""
    from helpers import spawn
    proc = job_guard.proc(spawn([PYTHON, "-m", "orchestrator.cli", "submit", *_long_job_args(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    head = ""
    for line in proc.stdout:
        head += line
        if ": run dir " in line:
            break
    job = _job_id(head)
    rd = RunDir(JobStore().get(job).run_dir)
    wait_until(lambda: len(rd.agents()) == 2 and rd.furthest_step(), 180, 0.2, "training to step")
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    os.kill(proc.pid, sig)
    proc.wait(60)
    wait_gone(lambda: [p for t in tokens for p in marked(t)], 30)
    st = cli("status", job, "--json")
    assert st.returncode == 0, st.stderr
    data = json.loads(st.stdout)
    if sig == signal.SIGKILL:
        assert data["state"] == "FAILED", data
        assert "supervising process is gone" in (data["root_cause"] or ""), data["root_cause"]
    else:
        assert data["state"] == "CANCELLED", data
    ls = cli("ls", "--json")
    assert [j["state"] for j in json.loads(ls.stdout) if j["id"] == job] == [data["state"]]


@pytest.mark.health
def test_restart_with_start_up_slower_than_stall_timeout_completes(tmp_path, job_guard):
    """Attempt 1 fails on rank 1 at step 5; attempt 2 takes 6 s (> stall_timeout 3 s) before its first step: the
    restart's health starts from its own records (a new boot is start-up), so it completes after one restart."""
    import yaml
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "recipe": "sft", "model": {"name_or_path": "tiny-llama"},
        "data": {"path": str(REPO / "recipes" / "data" / "sft_tiny.jsonl")}, "trainer": {"max_steps": 5},
        "health": {"stall_timeout": 3, "startup_timeout": 120, "poll_interval": 0.5, "max_restarts": 1}}))
    prep = api.prepare(str(recipe), nodes=2, cwd=tmp_path, check_trainer=False)
    out = tmp_path / "out"
    out.mkdir()
    plan = dataclasses.replace(prep.plan, node_plans=tuple(
        dataclasses.replace(n, command=n.command[:5] + (str(PROBE), str(out), "restart:6"))
        for n in prep.plan.node_plans))
    prep = dataclasses.replace(prep, plan=plan, files=render_files(plan, prep.recipe.to_dict()))
    job_guard.run_dir(plan.run_dir)
    res = running.submit(prep)
    assert res.state == "COMPLETED", res.root_cause
    assert res.restarts == 1 and (out / "attempts").read_text() == "2"
    rec = JobStore().get(plan.job_id)
    assert rec.state == "COMPLETED" and rec.restarts == 1
    attempts = RunDir(plan.run_dir).attempts()
    assert [a.decision for a in attempts] == ["restart"] and "node 1" in attempts[0].reason

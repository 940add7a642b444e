"""Own code on every backend (issue #12): a user's Hugging Face Trainer script that never imports orchestrate, as a
`run: {script: ...}` job on 2 nodes on this machine (local), over real sshd hosts (ssh) and on the SLURM testbed:
COMPLETED, per-step heartbeats from every rank written by the zero-code hooks, the same parameters on every rank
(gradients synced); and the same script failing: a rank that raises, is SIGKILLed or SIGSTOPped is named; a rank
that fails after the work while the others ended well ends the job at once (no 300 s exit barrier). The
fault behaviour of a plain torch loop (SIGKILL, SIGSTOP named through torch's optimizer-step hook, sys.exit(3)) on
every backend is tests/faults/test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

import jobrun
from helpers import rank_pids, wait_gone, wait_until
from orchestrator import api
from orchestrator.node.heartbeat import read_all
from orchestrator.node.proctools import marked
from orchestrator.node.ranklines import split_rank
from orchestrator.node.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("user_train.py")


def _user_job(backend: str, tmp_path: Path, request, job_guard, steps: int, health: dict, *extra: str,
              script: Path = SCRIPT, save_on_signal: bool = True):
    """(launcher, plan, run dir, hosts) of `user_train.py` (or `script`, with STEPS and `extra` for its arguments)
    as a `run: {script: ...}` job on 2 nodes of `backend`, its run dir written and guarded."""
    overrides: list[str] = []
    cluster_file = None
    out = tmp_path / "out"
    if backend == "ssh":
        tb = request.getfixturevalue("fault_sshd")
        cluster_file = tmp_path / "ssh.yaml"
        cluster_file.write_text(yaml.safe_dump(tb.cluster("faultlab")))
    elif backend == "slurm":
        request.getfixturevalue("fault_slurm")
        from slurm_helpers import WORK
        cluster_file = REPO / "cluster_configs" / "slurm_local.yaml"
        overrides = [f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}"]
        out = Path(WORK) / f"out-{tmp_path.name}"
    if script == SCRIPT:
        from recipes.tiny import resolve_model_path
        args = [resolve_model_path("tiny-llama"), str(REPO / "recipes/data/sft_tiny.jsonl"), str(out), str(steps)]
    else:
        args = [str(steps)]
    job = tmp_path / "my_job.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(script), "args": [*args, *extra]}, "health": health,
                                   "checkpoint": {"save_on_signal": save_on_signal}}))
    prep = api.prepare(str(job), str(cluster_file) if cluster_file else None, nodes=2, cwd=tmp_path,
                       overrides=overrides)
    rd = RunDir(prep.plan.run_dir)
    api.write_files(prep.files, rd.root)
    job_guard.run_dir(rd.root)
    from launchers import launcher_for
    return launcher_for(prep.cluster), prep.plan, rd, [n.host for n in prep.plan.node_plans]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "ssh", "slurm"])
def test_users_trainer_script_on_two_nodes(backend, tmp_path, request, job_guard):
    launcher, plan, rd, _ = _user_job(backend, tmp_path, request, job_guard, 8,
                                      {"stall_timeout": 120, "startup_timeout": 300})
    lines: list = []
    res = jobrun.run(launcher, plan, rd.root, lines=lines, timeout=600)
    text = "\n".join(f"[node{r}] {line}" for r, line in lines)
    assert res.state == "COMPLETED", res.root_cause + "\n" + text[-3000:]
    said = [split_rank(line)[1] for _, line in lines]  # (a rank's line is tagged `[rankG]: `)
    params = [json.loads(line.split(" ", 1)[1]) for line in said if line.startswith("USER_PARAMS ")]
    assert sorted(p["rank"] for p in params) == [0, 1] and {p["world"] for p in params} == {2}, text[-3000:]
    assert len({p["sha"] for p in params}) == 1, params  # the same parameters on every rank: gradients synced
    beats = read_all(rd.heartbeats)
    for rank in (0, 1):
        steps = sorted({b["step"] for b in beats if b.get("rank") == rank and b.get("event") == "step"})
        assert steps and steps[-1] == 8, (rank, steps)  # written by the hooks: the script writes none
        assert any(b.get("loss") is not None for b in beats if b.get("rank") == rank and b.get("event") == "step")


STALL = 4.0


@pytest.mark.health
@pytest.mark.parametrize("backend,fault", [("local", "raise"), ("local", "sigkill"), ("local", "sigstop"),
                                           ("ssh", "raise"), ("slurm", "raise")])
def test_users_trainer_script_faults_are_named(backend, fault, tmp_path, request, job_guard):
    """The same user script, one rank failing mid-training, the script unchanged but for its own error: a rank that
    raises is the root cause with its host, rank and exception line; SIGKILL: named, every process gone within
    1.5 s of the kill; SIGSTOP: named hung within stall_timeout + 5 s (found by the injected Trainer hooks)."""
    launcher, plan, rd, hosts = _user_job(backend, tmp_path, request, job_guard, 100_000,
                                          {"stall_timeout": STALL, "startup_timeout": 300, "max_restarts": 0},
                                          *(["3"] if fault == "raise" else []), save_on_signal=False)
    t0 = time.monotonic()
    job = jobrun.start(launcher, plan, rd.root)
    if fault == "raise":
        res = job.result(300)
        host1 = hosts[1] or rd.agent(1).host  # (SLURM: the allocation's node, recorded by its agent)
        assert (res.state, res.returncode) == ("FAILED", 1), res
        assert res.root_cause.startswith(f"node 1 ({host1}) failed: rank 1 ") and \
            res.root_cause.endswith(" | rank 1: RuntimeError: loss is nan at step 3"), res.root_cause
        return
    wait_until(lambda: rd.furthest_step() and rd.furthest_step() >= 3, 180, 0.1, "both ranks stepping")
    victim = rank_pids(rd.root)[1]
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    os.kill(victim, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
    t_fault = time.monotonic()
    res = job.result(120)
    took = time.monotonic() - t_fault
    gone = wait_gone(lambda: [p for t in tokens if t for p in marked(t)], 20)
    print(f"{backend}/{fault}: {res.state} after {took:.2f}s, all gone {gone:.2f}s later (job {t_fault - t0:.1f}s "
          f"in): {res.root_cause[:200]}")
    assert res.state == "FAILED", res
    if fault == "sigkill":
        assert res.root_cause.startswith(f"node 1 ({hosts[1]}) failed: rank 1 (pid {victim}) died of SIGKILL"), \
            res.root_cause
        assert took + gone <= 1.5, (took, gone)
    else:
        # (a hang names the host as the job does: the cluster file's host, SLURM's node; never the machine's own
        # name where the job names it otherwise, as every SSH testbed host would be)
        host1 = hosts[1] or rd.agent(1).host
        assert res.hung and res.root_cause.startswith("hang at "), res.root_cause  # (core.hangs)
        assert f"rank 1 (process {victim} is stopped)" in res.root_cause and f"rank 1 runs on {host1}" in \
            res.root_cause, res.root_cause
        assert took <= STALL + 5, took


@pytest.mark.health
@pytest.mark.parametrize("backend", ["ssh", "slurm"])
def test_a_trainer_stuck_in_its_data_loader_is_named_with_the_collective(backend, tmp_path, request, job_guard):
    """Issue #34: the user's HF Trainer script, rank 1's data loader stuck at its 4th batch, over SSH hosts and
    inside a SLURM allocation (the in-allocation monitor judges): the root cause names rank 1 as never having entered
    the collective where the job stopped, with where it is stuck; diagnosis.json is kept in the run dir."""
    launcher, plan, rd, hosts = _user_job(backend, tmp_path, request, job_guard, 100,
                                          {"stall_timeout": STALL, "startup_timeout": 300, "max_restarts": 0},
                                          "hang:4", save_on_signal=False)
    res = jobrun.start(launcher, plan, rd.root).result(400)
    print(f"{backend}/data loader hang: {res.state}: {res.root_cause[:300]}")
    assert res.state == "FAILED" and res.hung, res
    assert res.root_cause.startswith("hang at ") and "rank 1 never entered it; rank 1 is in user_train.py:" in \
        res.root_cause and "(time.sleep(3600))" in res.root_cause, res.root_cause
    host1 = hosts[1] or rd.agent(1).host
    assert f"rank 1 runs on {host1}" in res.root_cause, res.root_cause
    diag = rd.diagnosis()
    assert diag["culprits"][0] == 1 and diag["collective"]["op"], diag


@pytest.mark.health
def test_a_loop_without_an_optimizer_is_named_hung_through_beat(tmp_path, request, job_guard):
    """A loop that steps no optimizer and imports no torch (tests/faults/beat_loop.py) with the opt-in standard-library
    `orchestrate_heartbeat.beat()`: its steps reach the monitor, and a SIGSTOPped rank is named hung within
    stall_timeout + 5 s."""
    launcher, plan, rd, hosts = _user_job("local", tmp_path, request, job_guard, 100_000,
                                          {"stall_timeout": STALL, "startup_timeout": 120, "max_restarts": 0},
                                          script=Path(__file__).with_name("beat_loop.py"))
    job = jobrun.start(launcher, plan, rd.root)
    wait_until(lambda: rd.furthest_step() and rd.furthest_step() >= 5, 120, 0.1, "both ranks beating")
    victim = rank_pids(rd.root)[1]
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    os.kill(victim, signal.SIGSTOP)
    t_fault = time.monotonic()
    res = job.result(120)
    took = time.monotonic() - t_fault
    wait_gone(lambda: [p for t in tokens if t for p in marked(t)], 20)
    print(f"beat loop/sigstop: {res.state} after {took:.2f}s: {res.root_cause[:200]}")
    assert res.state == "FAILED" and res.hung, res
    assert res.root_cause.startswith("hang") and f"rank 1 (process {victim} is stopped)" in res.root_cause and \
        f"rank 1 runs on {hosts[1]}" in res.root_cause, res.root_cause  # (core.hangs)
    assert "ranks 0 also silent" not in res.root_cause, res.root_cause  # rank 0 beats on: only rank 1 is named
    assert took <= STALL + 5, took


@pytest.mark.health
@pytest.mark.parametrize("backend", ["local", "ssh", "slurm"])
def test_a_rank_failing_after_the_work_ends_the_job_at_once(backend, tmp_path, request, job_guard):
    """Rank 1 exits 3 once the work is done, rank 0 ends well (tests/faults/exit_after_work.py, a plain gloo loop).
    Node 1's torchrun exits without reaching torchelastic's exit barrier, where node 0's torchrun then waits 300 s
    (what a hand-run per-node `accelerate launch` does). Here node 1's end is the root cause, named with its exit
    code, and node 0 is torn down within seconds: FAILED, every process gone."""
    launcher, plan, rd, hosts = _user_job(backend, tmp_path, request, job_guard, 5,
                                          {"stall_timeout": 60, "startup_timeout": 120, "max_restarts": 0},
                                          script=Path(__file__).with_name("exit_after_work.py"))
    job = jobrun.start(launcher, plan, rd.root)
    res = job.result(120)
    ended = time.time()
    tokens = [job_guard.token(a.token) for a in rd.agents().values()]
    gone = wait_gone(lambda: [p for t in tokens if t for p in marked(t)], 20)
    node1 = rd.exit(1)
    host1 = hosts[1] or rd.agent(1).host  # (SLURM: the allocation's node, recorded by its agent)
    print(f"{backend}, exit after the work: {res.state} {ended - node1.time:.2f}s after node 1 ended, all gone "
          f"{gone:.2f}s later: {res.root_cause[:200]}")
    assert (res.state, res.returncode) == ("FAILED", 3), res
    assert res.root_cause.startswith(f"node 1 ({host1}) failed: rank 1 ") and "code 3" in res.root_cause, \
        res.root_cause
    assert "WORK_DONE rank 0" in rd.path(RunDir.log_rel(0)).read_text()  # rank 0 ended well: node 0 was waiting
    assert node1.returncode != 0 and ended - node1.time <= 5, (node1, ended)
    assert gone <= 5, gone

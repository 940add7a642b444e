"""A real 2-node tiny SFT over SSH (gloo on CPU): gradients in sync, secrets kept out, faults mid-training."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import first_step_seen, rank_pids, wait_until
from ssh_helpers import REPO, agent_info, remote_run_dir, wait_gone
from orchestrator.node.ranklines import split_rank

pytestmark = pytest.mark.slow


@pytest.fixture
def sft(testbed, tmp_path, monkeypatch, job_guard):
    """sft(max_steps) -> (launcher, submission, plan, local run dir) for recipes/configs/sft_tiny.yaml on 2 hosts.
    Each job's run dirs (local and per host) are registered with job_guard: a failing test leaves nothing running."""
    from launchers.ssh.launcher import SSHLauncher
    from orchestrator import api

    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(testbed.cluster()))

    def make(max_steps: int, secret_env=(), extra=()):
        over = [f"trainer.max_steps={max_steps}", f"trainer.output_dir={tmp_path / 'out'}", *extra]
        if secret_env:
            over.append("launch.secret_env=[" + ",".join(secret_env) + "]")
        prepared = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(cluster_file), nodes=2,
                               overrides=over, cwd=REPO)
        local = tmp_path / "home" / "runs" / prepared.plan.job_id
        api.write_files(prepared.files, local)
        job_guard.run_dir(local, *(remote_run_dir(testbed, n.host, prepared.plan.job_id)
                                   for n in prepared.plan.node_plans))
        launcher = SSHLauncher(prepared.cluster)
        return launcher, launcher.prepare(prepared.plan), prepared.plan, local
    return make


def _submit(launcher, sub, local: Path):
    """Start the job (pre-flight, copy, agents); the running job for `_wait`."""
    from orchestrator.node.rundir import RunDir
    return launcher.submit(sub, RunDir(local))


def _wait(plan, job, on_line=None):
    """Supervise the job to its end, as `orchestrate submit` does: the JobResult."""
    from orchestrator.supervise import Supervisor
    return Supervisor(plan, on_line=on_line).run(job)


def test_two_node_sft_trains_in_sync_and_keeps_secrets(testbed, sft, monkeypatch):
    canary = "hf_CANARY_" + os.urandom(8).hex()
    monkeypatch.setenv("HF_TOKEN", canary)
    launcher, sub, plan, local = sft(10, secret_env=("HF_TOKEN",))
    t0 = time.monotonic()
    job = _submit(launcher, sub, local)
    lines: list[str] = []
    res = _wait(plan, job, on_line=lambda r, line: lines.append(line))
    wall = time.monotonic() - t0
    print(f"2-node SFT over SSH: {res.state} in {wall:.1f}s")
    assert res.state == "COMPLETED", res.root_cause
    result = json.loads(next(t for t in (split_rank(x)[1] for x in lines) if t.startswith("ORCHESTRATE_RESULT "))[19:])
    assert result["world_size"] == 2
    ranks = result["ranks"]
    assert len(ranks) == 2
    assert ranks[0]["param_sha"] == ranks[1]["param_sha"], "parameters differ: gradients not synced"
    assert ranks[0]["first_batch_sha"] != ranks[1]["first_batch_sha"], "same first batch: not data parallel"
    assert result["final_loss"] < result["first_loss"]
    # heartbeats came back from both hosts
    assert (local / "heartbeats").exists() and len(list((local / "heartbeats").glob("rank*.jsonl"))) == 2
    # the canary is nowhere: local run dir, remote run dirs, logs, store
    for root in (local, Path(testbed.dir) / "work", Path(os.environ["ORCHESTRATE_HOME"])):
        for p in root.rglob("*"):
            if p.is_file():
                assert canary.encode() not in p.read_bytes(), f"HF_TOKEN leaked into {p}"
    assert not any(canary in line for line in lines)


def _rank_pid(testbed, plan, node: int) -> tuple[int, list]:
    """The pid of node's training rank (the worker with RANK set, not `accelerate launch` whose argv also says
    recipes.run) and the job's recorded groups and tokens on every node (for ssh_helpers.wait_gone)."""
    groups: list = []
    for n in plan.node_plans:
        a = agent_info(testbed, n.host, plan.job_id, n.node_rank, timeout=30)
        groups += [a["agent_pgid"], a["pgid"], a["token"]]
    np = plan.node_plans[node]
    pid = wait_until(lambda: rank_pids(remote_run_dir(testbed, np.host, plan.job_id), node).get(np.ranks[0]), 30,
                     what=f"the rank process of node {node}")
    return pid, groups


def _wait_first_step(testbed, plan, timeout=60.0):
    run_dir = remote_run_dir(testbed, plan.node_plans[1].host, plan.job_id)
    wait_until(lambda: first_step_seen(run_dir, plan.node_plans[1].ranks[0]), timeout,
               what="training to reach its first step")


@pytest.mark.fault
def test_sigkill_rank_mid_training_fails_fast_with_root_cause(testbed, sft, record_property):
    launcher, sub, plan, local = sft(200)
    job = _submit(launcher, sub, local)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=_wait(plan, job)))
    t.start()
    _wait_first_step(testbed, plan)
    pid, groups = _rank_pid(testbed, plan, 1)
    t0 = time.monotonic()
    print(f"KILL at {time.time():.3f}", flush=True)
    os.kill(pid, signal.SIGKILL)
    gone = wait_gone(groups, timeout=20)
    t.join(30)
    res = box["r"]
    record_property("fault_to_all_gone_s", round(gone, 3))
    print(f"SIGKILL rank 1 mid-training: every process gone after {gone:.2f}s; result after "
          f"{time.monotonic() - t0:.2f}s; root cause: {res.root_cause[:200]}")
    assert res.state == "FAILED"
    assert res.root_cause.startswith(f"node 1 ({testbed.hosts[1]})"), res.root_cause
    assert gone < 6


@pytest.mark.fault
@pytest.mark.health
def test_sigstop_rank_mid_training_is_detected_as_hang(testbed, sft, record_property):
    """A stopped rank blocks its peer in a collective: no node fails. The health monitor on the submit host
    sees the heartbeats (forwarded over SSH) stop and tears the job down within stall_timeout + a few s."""
    launcher, sub, plan, local = sft(400, extra=("health.stall_timeout=8", "health.poll_interval=0.5"))
    job = _submit(launcher, sub, local)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=_wait(plan, job)))
    t.start()
    _wait_first_step(testbed, plan)
    time.sleep(1.0)  # past the first step: the training clock (stall_timeout) applies, not startup_timeout
    pid, groups = _rank_pid(testbed, plan, 1)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    t.join(60)
    detected = time.monotonic() - t0
    gone = wait_gone(groups, timeout=20)
    res = box["r"]
    record_property("hang_detected_s", round(detected, 3))
    print(f"SIGSTOP rank 1 over SSH: hang detected and torn down after {detected:.2f}s (stall_timeout 8s); "
          f"root cause: {res.root_cause[:200]}")
    assert res.state == "FAILED" and res.hung, res
    assert res.root_cause.startswith("hang at "), res.root_cause  # (core.hangs, over the evidence carried back)
    assert f"rank 1 (process {pid} is stopped)" in res.root_cause  # (the host as the cluster file names it, not 'vm')
    assert f"rank 1 runs on {plan.node_plans[1].host}" in res.root_cause, res.root_cause
    stacks = remote_run_dir(testbed, plan.node_plans[1].host, plan.job_id) / "stacks" / "rank1.txt"
    assert stacks.exists() and stacks.read_text().strip()
    assert detected < 8 + 8
    assert gone < 10


def test_two_nodes_two_processes_each_train_in_sync(testbed, sft):
    launcher, sub, plan, local = sft(6, extra=("launch.procs_per_node=2",))
    assert plan.world_size == 4
    lines: list[str] = []
    res = _wait(plan, _submit(launcher, sub, local), on_line=lambda r, line: lines.append(line))
    assert res.state == "COMPLETED", res.root_cause
    result = json.loads(next(t for t in (split_rank(x)[1] for x in lines) if t.startswith("ORCHESTRATE_RESULT "))[19:])
    ranks = result["ranks"]
    assert result["world_size"] == 4 and len(ranks) == 4
    assert len({r["param_sha"] for r in ranks}) == 1, "parameters differ across the 4 ranks"
    assert len({r["first_batch_sha"] for r in ranks}) == 4, "ranks saw the same data"


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.fault
def test_node_loses_sshd_and_agent_mid_training(testbed, sft, record_property):
    """Host 2's sshd (daemon and our session) and its node agent are SIGKILLed mid-training: the submit host
    loses the node (connection gone), tears the other node down; on host 2 nothing is left either (the launch
    gets SIGTERM from PR_SET_PDEATHSIG when its agent dies; torchrun stops its ranks). Then sshd is restarted."""
    import sshd_hosts
    launcher, sub, plan, local = sft(400)
    job = _submit(launcher, sub, local)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=_wait(plan, job)))
    t.start()
    _wait_first_step(testbed, plan)
    _, groups = _rank_pid(testbed, plan, 1)
    host = plan.node_plans[1].host
    daemon = testbed.pids[host]
    agent = agent_info(testbed, host, plan.job_id, 1)["agent_pid"]
    sshds = [daemon] + [p for p in _descendants(daemon)
                        if Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().strip() == "sshd"]
    t0 = time.monotonic()
    for pid in [*sshds, agent]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        gone = wait_gone(groups, timeout=40)
        t.join(60)
        res = box["r"]
        record_property("fault_to_all_gone_s", round(gone, 3))
        print(f"sshd + agent of node 1 SIGKILLed: every process on every host gone after {gone:.2f}s; "
              f"result after {time.monotonic() - t0:.2f}s: {res.state}: {res.root_cause[:160]}")
        assert res.state == "FAILED"
        assert f"node 1 ({host})" in res.root_cause, res.root_cause
    finally:  # bring host 2's sshd back for the rest of the session (same host key)
        sshd_hosts.restart(testbed, host)

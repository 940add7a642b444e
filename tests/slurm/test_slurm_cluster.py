"""The SLURM backend on a real local cluster (scripts/slurm_cluster.sh): submitit and hand-submitted
job.sbatch, fail-fast, cancel, requeue -> checkpoint -> resume, a real time limit. All marked `slurm`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import spawn
from slurm_helpers import (REPO, WORK, heartbeat_step, local_cluster, node_namespace_leftovers, trivial_plan,
                           wait_clean, wait_until)
from orchestrator.types import JobHandle
from launchers.slurm.launcher import SlurmJob, SlurmLauncher
from orchestrator.node.ranklines import split_rank
from orchestrator.node.rundir import RunDir
import jobrun
from orchestrator.errors import ConfigError

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


def sacct_state(jid: str) -> str:
    r = subprocess.run(["sacct", "-X", "-n", "-P", "-j", jid, "-o", "State"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


# ------------------------------------------------------------------------------- the cluster itself

def test_cluster_runs_two_nodes_and_sacct(slurm_cluster):
    r = subprocess.run(["srun", "-N2", "hostname"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["node1", "node2"]
    # slurmdbd records the job a moment after it ends: poll (the first job of a fresh cluster takes longest)
    deadline = time.monotonic() + 30
    while True:
        r = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-S", "now-1hour"], capture_output=True,
                           text=True, timeout=30)
        if (r.returncode == 0 and "COMPLETED" in r.stdout) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.returncode == 0 and "COMPLETED" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------- mechanics (trivial payload)

@pytest.mark.parametrize("mode", ["submitit", "sbatch"])
def test_trivial_job_both_paths(slurm_cluster, mode):
    L = SlurmLauncher(local_cluster())
    plan = trivial_plan(f"triv-{mode}", ["5", "--sleep", "0.1"])
    sub = L.prepare(plan)
    h = L.submit(sub, RunDir(plan.run_dir)) if mode == "submitit" else L.submit_sbatch(sub, RunDir(plan.run_dir))
    lines: list[tuple[int, str]] = []
    res = jobrun.watch(h, plan, lines=lines, timeout=120)
    assert res.state == "COMPLETED", res
    text = "\n".join(line for _, line in lines)
    # each node bound its own rank inside its task; hosts node1, node2
    assert "payload: node 0 on node1" in text and "payload: node 1 on node2" in text
    agents = [json.loads((Path(plan.run_dir) / "nodes" / str(r) / "agent.json").read_text()) for r in range(2)]
    assert [a["node_rank"] for a in agents] == [0, 1] and {a["main_ip"] for a in agents} == {"node1"}
    assert L.status(h.handle, RunDir(plan.run_dir)).state == "COMPLETED"
    assert sacct_state(h.handle.data["job_id"]) == "COMPLETED"
    assert any("payload: node 1 done" in x for x in L.logs(h.handle, RunDir(plan.run_dir), 1))
    assert wait_clean() == {}


def test_failed_rank_ends_job_fast_and_names_it(slurm_cluster):
    L = SlurmLauncher(local_cluster())
    plan = trivial_plan("fail", ["600", "--sleep", "0.1", "--fail-at", "10", "--fail-node", "1"])
    h = L.submit(L.prepare(plan), RunDir(plan.run_dir))
    wait_until(lambda: heartbeat_step(plan.run_dir) >= 10, 60, "node 1 to reach step 10")
    t0 = time.monotonic()
    res = jobrun.watch(h, plan, timeout=60)
    assert time.monotonic() - t0 < 8
    assert res.state == "FAILED" and res.returncode == 7
    assert "node 1 (node2)" in res.root_cause and "exit code 7" in res.root_cause, res.root_cause
    assert wait_clean(10) == {}


def test_scancel_cancels_everything(slurm_cluster):
    L = SlurmLauncher(local_cluster())
    plan = trivial_plan("cancel", ["6000", "--sleep", "0.1"])
    h = L.submit(L.prepare(plan), RunDir(plan.run_dir))
    wait_until(lambda: heartbeat_step(plan.run_dir) >= 3, 60, "the job to run")
    t0 = time.monotonic()
    L.cancel(h.handle)
    res = jobrun.watch(h, plan, timeout=60)
    assert res.state == "CANCELLED" and time.monotonic() - t0 < 10
    assert wait_clean(15) == {}, node_namespace_leftovers()


@pytest.mark.parametrize("mode", ["submitit", "sbatch"])
def test_usr2_preemption_checkpoint_requeue_resume(slurm_cluster, mode):
    """USR2 as SLURM sends it ahead of the limit -> every rank saves -> requeue -> resume from the save."""
    L = SlurmLauncher(local_cluster())
    plan = trivial_plan(f"pre-{mode}", ["80", "--sleep", "0.1", "--save-dir", "CKPT"])
    ckpt = Path(plan.run_dir) / "ckpt"
    plan = replace(plan, node_plans=tuple(replace(n, command=tuple(str(ckpt) if a == "CKPT" else a for a in n.command))
                                          for n in plan.node_plans))
    (Path(plan.run_dir) / "plan.json").write_text(plan.to_json())
    sub = L.prepare(plan)
    h = L.submit(sub, RunDir(plan.run_dir)) if mode == "submitit" else L.submit_sbatch(sub, RunDir(plan.run_dir))
    jid = h.handle.data["job_id"]
    wait_until(lambda: heartbeat_step(plan.run_dir) >= 15, 60, "step 15")
    # submitit puts USR2 on the steps (--signal=USR2@lead); job.sbatch on the batch shell (B:USR2@lead)
    target = ["--batch"] if mode == "sbatch" else []
    subprocess.run(["scancel", *target, "--signal=USR2", jid], check=True)
    res = jobrun.watch(h, plan, timeout=180)
    assert res.state == "COMPLETED", res
    saved = json.loads((ckpt / "ckpt.json").read_text())["step"]
    log0 = (Path(plan.run_dir) / "logs" / "node0.log").read_text()
    assert f"payload: resumed from step {saved}" in log0 and saved >= 10
    assert "payload: node 0 done at step 80" in log0
    q = L.query(h.handle)
    assert q["restarts"] == 1
    hist = [json.loads(x) for x in (Path(plan.run_dir) / "restarts.jsonl").read_text().splitlines()]
    assert [x["decision"] for x in hist] == ["restart"]


@pytest.mark.slow
def test_real_time_limit_signal_requeues(slurm_cluster):
    """--time 2 min, USR2 60 s ahead: the signal comes from SLURM's own time limit handling."""
    L = SlurmLauncher(local_cluster(time="00:02:00", signal_lead_s=60))
    plan = trivial_plan("tlimit", ["500", "--sleep", "0.2", "--save-dir", "CKPT"])
    ckpt = Path(plan.run_dir) / "ckpt"
    plan = replace(plan, node_plans=tuple(replace(n, command=tuple(str(ckpt) if a == "CKPT" else a for a in n.command))
                                          for n in plan.node_plans))
    (Path(plan.run_dir) / "plan.json").write_text(plan.to_json())
    h = L.submit_sbatch(L.prepare(plan), RunDir(plan.run_dir))
    res = jobrun.watch(h, plan, timeout=480)
    log0 = (Path(plan.run_dir) / "logs" / "node0.log").read_text()
    assert "payload: resumed from step" in log0, log0[-2000:]
    hist = [json.loads(x) for x in (Path(plan.run_dir) / "restarts.jsonl").read_text().splitlines()]
    assert hist and hist[0]["decision"] == "restart"
    assert res.state == "COMPLETED", res


# ------------------------------------------------------------------------------- bad input before sbatch

def test_bad_input_is_a_config_error_before_sbatch(slurm_cluster):
    L = SlurmLauncher(local_cluster(partition="nosuchpartition"))
    plan = trivial_plan("badpart", ["1"])
    with pytest.raises(ConfigError) as e:
        L.submit(L.prepare(plan), RunDir(plan.run_dir))
    assert e.value.exit_code == 2 and "slurm.partition" in str(e.value)
    assert not (Path(plan.run_dir) / "slurm_job_id").exists()
    with pytest.raises(ConfigError) as e:
        SlurmLauncher(local_cluster(gpus_per_node=4)).prepare(plan)
    assert "slurm.gpus_per_node" in str(e.value)
    with pytest.raises(ConfigError) as e:
        SlurmLauncher(local_cluster(time="00:00:20", signal_lead_s=30)).prepare(plan)
    assert "slurm.time" in str(e.value)


# ------------------------------------------------------------------------------- real training

def _prepare_sft(tag: str, *overrides: str):
    from orchestrator import api
    out = Path(os.environ.get("ORCHESTRATE_SLURM_WORK", "/tmp/orchestrate-slurm-work")) / f"out-{tag}-{time.time_ns()}"
    cl = REPO / "cluster_configs" / "slurm_local.yaml"
    return api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(cl), nodes=2, cwd=REPO,
                       overrides=[f"cluster.slurm.python={sys.executable}",
                                  f"cluster.slurm.workdir={os.environ.get('ORCHESTRATE_SLURM_WORK', WORK)}",
                                  f"trainer.output_dir={out}", *overrides])


def _result(run_dir: str) -> dict:
    text = (Path(run_dir) / "logs" / "node0.log").read_text()
    lines = [t for t in (split_rank(ln)[1] for ln in text.splitlines()) if t.startswith("ORCHESTRATE_RESULT ")]
    assert lines, text[-3000:]
    return json.loads(lines[-1][len("ORCHESTRATE_RESULT "):])


def _assert_synced(result: dict) -> None:
    assert result["world_size"] == 2
    ranks = result["ranks"]
    assert len({r["param_sha"] for r in ranks}) == 1, ranks  # same weights on both nodes
    assert len({r["first_batch_sha"] for r in ranks}) == 2, ranks  # ... from different data: really distributed


def test_sft_two_nodes_through_the_launcher(slurm_cluster):
    from orchestrator import running
    prep = _prepare_sft("submitit")
    res = running.submit(prep)
    assert res.state == "COMPLETED", res
    r = _result(prep.plan.run_dir)
    _assert_synced(r)
    assert r["global_step"] == r["max_steps"] and r["final_loss"] < r["first_loss"]
    assert wait_clean() == {}


def test_sft_two_nodes_hand_submitted_sbatch(slurm_cluster):
    """The rendered job.sbatch, submitted with plain `sbatch` as a user would."""
    from orchestrator import api
    prep = _prepare_sft("sbatch")
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    sub = SlurmLauncher(prep.cluster).prepare(prep.plan)
    api.write_files(sub.files, run_dir)
    r = subprocess.run(["sbatch", "--parsable", str(run_dir / "job.sbatch")], capture_output=True, text=True,
                       cwd="/", timeout=60)
    assert r.returncode == 0, r.stderr
    jid = r.stdout.strip()
    h = JobHandle(f"slurm://{jid}", {"run_dir": str(run_dir), "job_id": jid, "nodes": 2})
    res = jobrun.watch(SlurmJob(SlurmLauncher(prep.cluster), h, RunDir(run_dir), 2), prep.plan, timeout=300)
    assert res.state == "COMPLETED", res
    _assert_synced(_result(str(run_dir)))
    assert wait_clean() == {}


def _rank_pid(ns: str) -> int | None:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in r.stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"recipes.run" in cmd and b"accelerate.commands.launch" not in cmd:
            return int(pid)
    return None


def test_sft_rank_killed_fails_within_seconds(slurm_cluster):
    from orchestrator.types import JobHandle  # noqa: F401
    from orchestrator import api
    prep = _prepare_sft("kill", "trainer.max_steps=100000")
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    L = SlurmLauncher(prep.cluster)
    h = L.submit(L.prepare(prep.plan), RunDir(prep.plan.run_dir))
    wait_until(lambda: heartbeat_step(run_dir) >= 5, 180, "training to reach step 5")
    pid = wait_until(lambda: _rank_pid("osl-node2"), 10, "the rank process on node2")
    t0 = time.monotonic()
    os.kill(pid, 9)
    res = jobrun.watch(h, prep.plan, timeout=60)
    took = time.monotonic() - t0
    assert res.state == "FAILED", res
    assert took < 10, took
    assert "node 1 (node2)" in res.root_cause, res.root_cause
    assert wait_clean(10) == {}, node_namespace_leftovers()


@pytest.mark.health
def test_sft_hung_rank_detected_inside_the_allocation(slurm_cluster):
    """A SIGSTOPped rank: no task fails, but the node agents watch the shared heartbeats inside the allocation
    (no submitting terminal needed), name the stopped rank, keep stacks and end the job."""
    from orchestrator import api
    prep = _prepare_sft("hang", "trainer.max_steps=100000", "health.stall_timeout=8", "health.poll_interval=0.5")
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    L = SlurmLauncher(prep.cluster)
    h = L.submit(L.prepare(prep.plan), RunDir(prep.plan.run_dir))
    wait_until(lambda: heartbeat_step(run_dir) >= 5, 180, "training to reach step 5")
    pid = wait_until(lambda: _rank_pid("osl-node2"), 10, "the rank process on node2")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    res = jobrun.watch(h, prep.plan, timeout=90)
    took = time.monotonic() - t0
    print(f"SLURM: SIGSTOP of rank 1 -> job {res.state} after {took:.1f}s: {res.root_cause[:240]}")
    assert res.state == "FAILED", res
    assert f"rank 1 (process {pid} is stopped)" in res.root_cause and "rank 1 runs on node2" in res.root_cause, \
        res.root_cause  # (core.hangs, judged by the node agents inside the allocation)
    assert (run_dir / "stacks" / "rank1.txt").read_text().strip()
    assert took < 8 + 20, took
    assert wait_clean(10) == {}, node_namespace_leftovers()


@pytest.mark.health
def test_sft_hang_then_restart_in_a_new_allocation_resumes(slurm_cluster, tmp_path, monkeypatch):
    """health.max_restarts=1 on SLURM: a SIGSTOPped rank is detected as a hang inside the allocation, the job
    ends FAILED, `submit` asks SLURM for a NEW allocation (a new job id) and training resumes from the last
    checkpoint to the end; the restart and its reason are in the job record."""
    from orchestrator import running
    from orchestrator.store import JobStore
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    prep = _prepare_sft("restart", "trainer.max_steps=300", "trainer.save_strategy=steps", "trainer.save_steps=10",
                        "health.stall_timeout=8", "health.poll_interval=0.5", "health.max_restarts=1")
    run_dir = Path(prep.plan.run_dir)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=running.submit(prep)), daemon=True)
    t.start()
    wait_until(lambda: heartbeat_step(run_dir) >= 25, 180, "training to pass its checkpoint at step 20")
    first_job = (run_dir / "slurm_job_id").read_text().strip()
    pid = wait_until(lambda: _rank_pid("osl-node2"), 10, "the rank process on node2")
    os.kill(pid, signal.SIGSTOP)
    t.join(400)
    res = box["r"]
    assert res.state == "COMPLETED", res
    assert res.restarts == 1
    second_job = (run_dir / "slurm_job_id").read_text().strip()
    assert second_job != first_job, "the restart did not get a new allocation"
    r = _result(str(run_dir))
    m = re.search(r"checkpoint-(\d+)", str(r["resumed_from"]))
    assert m and int(m.group(1)) >= 20, r["resumed_from"]
    assert r["global_step"] == 300
    rec = JobStore().get(prep.plan.job_id)
    assert rec.state == "COMPLETED" and rec.restarts == 1, rec
    history = " ".join(str(e) for e in JobStore().events(prep.plan.job_id))
    assert "RESTARTING" in history and "hang at " in history and "is stopped" in history, history  # (core.hangs)
    assert wait_clean(10) == {}, node_namespace_leftovers()


def test_sft_scontrol_requeue_checkpoints_and_resumes(slurm_cluster):
    """`scontrol requeue` (what preemption with PreemptMode=REQUEUE does): the ranks get SIGTERM, save a
    checkpoint, the job runs again and resumes from it (asserted on the global step)."""
    from orchestrator import api
    prep = _prepare_sft("requeue", "trainer.max_steps=300")
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    L = SlurmLauncher(prep.cluster)
    h = L.submit(L.prepare(prep.plan), RunDir(prep.plan.run_dir))
    wait_until(lambda: heartbeat_step(run_dir) >= 20, 180, "training to reach step 20")
    subprocess.run(["scontrol", "requeue", h.handle.data["job_id"]], check=True)
    res = jobrun.watch(h, prep.plan, timeout=400)
    assert res.state == "COMPLETED", res
    r = _result(str(run_dir))
    assert r["resumed_from"], r
    m = re.search(r"checkpoint-(\d+)", str(r["resumed_from"]))
    assert m and int(m.group(1)) >= 20
    assert r["global_step"] == 300
    assert L.query(h.handle)["restarts"] >= 1
    from orchestrator.running import restart_count
    attempts = RunDir(run_dir).attempts()
    assert restart_count(RunDir(run_dir)) >= 1, attempts  # counted by us too, with its reason
    assert any("requeued by SLURM" in a.reason for a in attempts), attempts


@pytest.mark.health
@pytest.mark.parametrize("how", ["sigkill", "sighup", "output-gone"])
def test_cli_job_outlives_its_submitting_terminal(slurm_cluster, tmp_path, how):
    """`orchestrate submit` to SLURM, then the submitting process is SIGKILLed, or gets SIGHUP (its terminal hung
    up), or finds its output gone (a write fails: a hung-up terminal's EIO can come before the SIGHUP; here a closed
    pipe's EPIPE): it stops watching, exit 129, where on local / SSH it would cancel. The job runs on in the
    allocation; `orchestrate status` asks SLURM and records the final state."""
    import json as _json
    env = dict(os.environ, ORCHESTRATE_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    work = os.environ.get("ORCHESTRATE_SLURM_WORK", "/tmp/orchestrate-slurm-work")
    cli = [sys.executable, "-m", "orchestrator.cli"]
    proc = spawn([*cli, "submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster",
                             str(REPO / "cluster_configs" / "slurm_local.yaml"),
                             f"cluster.slurm.python={sys.executable}",
                             f"cluster.slurm.workdir={work}", "trainer.max_steps=40",
                             f"trainer.output_dir={tmp_path / 'out'}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    job = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job is None:
        m = re.match(r"job (\S+): run dir", proc.stdout.readline())
        job = m.group(1) if m else None
    assert job, "no job id printed"

    def status():
        r = subprocess.run([*cli, "status", job, "--json"], cwd=REPO, env=env, capture_output=True, text=True)
        return _json.loads(r.stdout)
    wait_until(lambda: status()["state"] == "RUNNING", 60, "job recorded RUNNING")
    if how in ("sighup", "output-gone"):
        if how == "sighup":
            proc.send_signal(signal.SIGHUP)  # spawn: the child's SIGHUP disposition is the default, ours installs one
        proc.stdout.close()  # the next rank line it writes fails
        assert proc.wait(timeout=60) == 129
        from orchestrator.store import JobStore
        history = " ".join(str(e) for e in JobStore(tmp_path / "home" / "jobs.db").events(job))
        why = ("the submitting terminal hung up (SIGHUP)" if how == "sighup" else
               "the reader of the submit's output went away (broken pipe)")
        assert f"{why}: the job runs on under SLURM" in history, history
    else:
        proc.kill()
        proc.wait()
    st = wait_until(lambda: (lambda s: s if s.get("scheduler", "").startswith("RUNNING") else None)(status()), 60,
                    "SLURM reporting the job running without its terminal")
    assert st["state"] == "RUNNING"
    final = wait_until(lambda: (lambda s: s if s["state"] in ("COMPLETED", "FAILED") else None)(status()), 300,
                       "the job to end")
    assert final["state"] == "COMPLETED", final
    assert wait_clean(10) == {}, node_namespace_leftovers()


def test_a_hung_up_submit_with_notifications_watches_on_and_sends_the_end(slurm_cluster, tmp_path):
    """A SLURM job with a notify: block whose submitting terminal hangs up: the submit watches on, quietly (it sends
    the notifications), and when the job ends the `completed` event is delivered and the submit exits 0."""
    import json as _json
    env = dict(os.environ, ORCHESTRATE_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    events = tmp_path / "events.jsonl"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ncat >> {events}\necho >> {events}\n")
    hook.chmod(0o755)
    work = os.environ.get("ORCHESTRATE_SLURM_WORK", "/tmp/orchestrate-slurm-work")
    proc = spawn([sys.executable, "-m", "orchestrator.cli", "submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2",
                  "--cluster", str(REPO / "cluster_configs" / "slurm_local.yaml"),
                  f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={work}", "trainer.max_steps=20",
                  f"trainer.output_dir={tmp_path / 'out'}", "notify.on=[completed]", f"notify.command=[{hook}]"],
                 cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline and job is None:
            m = re.match(r"job (\S+): run dir", proc.stdout.readline())
            job = m.group(1) if m else None
        assert job, "no job id printed"
        for line in proc.stdout:  # (the job runs: its first rank line)
            if "rank" in line:
                break
        proc.send_signal(signal.SIGHUP)
        proc.stdout.close()
        assert proc.wait(timeout=300) == 0
        sent = [_json.loads(x) for x in events.read_text().splitlines() if x.strip()]
        assert [(e["event"], e["job_id"], e["state"]) for e in sent] == [("completed", job, "COMPLETED")], sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_clean(10) == {}, node_namespace_leftovers()


@pytest.mark.parametrize("how", ["sigint", "sighup", "sigint-test-only"])
def test_terminal_signal_while_sbatch_answers(slurm_cluster, tmp_path, job_guard, how):
    """Ctrl-C or a hang-up of the submitting terminal (sent to its whole foreground process group) while sbatch runs
    (a shim makes it take 3 s). sbatch, in a session of its own, is not interrupted (interrupted, it could die after
    SLURM queued the job but before printing its id: a job nobody records), so orchestrate gets the job id and acts:
    Ctrl-C -> the job stopped, CANCELLED, exit 130; hang-up -> it runs on under SLURM, exit 129, ends COMPLETED.
    Ctrl-C during the `sbatch --test-only` check before it (slowed instead): CANCELLED at once, nothing queued."""
    import shutil

    import yaml
    from launchers.slurm.launcher import read_job_id
    from orchestrator.store import JobStore
    real, bin_dir, started = shutil.which("sbatch"), tmp_path / "bin", tmp_path / "sbatch-started"
    bin_dir.mkdir()
    slow = "check" if how == "sigint-test-only" else "submit"  # which of sbatch's two calls takes 3 s
    (bin_dir / "sbatch").write_text(f"""#!/bin/sh
case "$1" in --test-only) call=check;; *) call=submit;; esac
[ "$call" = {slow} ] || exec {real} "$@"
touch {started}
sleep 3
exec {real} "$@"
""")
    (bin_dir / "sbatch").chmod(0o755)
    script = tmp_path / "short.py"
    script.write_text("import time\ntime.sleep(2)\nprint('SHORT done', flush=True)\n")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"run": {"script": str(script)}}))
    home = job_guard.home(tmp_path / "home")
    env = dict(os.environ, ORCHESTRATE_HOME=str(home), PATH=f"{bin_dir}:{os.environ['PATH']}")
    cli = [sys.executable, "-m", "orchestrator.cli"]
    proc = job_guard.spawn([*cli, "submit", str(job_file), "--nodes", "2", "--cluster",
                            str(REPO / "cluster_configs" / "slurm_local.yaml"),
                            f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}"], cwd=REPO,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)  # a process group of its own, like a shell's job
    head = []
    for line in proc.stdout:  # (printed before anything is submitted)
        head.append(line)
        if ": run dir " in line:
            break
    job = re.search(r"job (\S+): run dir", "".join(head))
    assert job, "".join(head) + proc.communicate(timeout=60)[0]
    job = job.group(1)
    try:
        wait_until(started.exists, 120, "sbatch to start")
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGHUP if how == "sighup" else signal.SIGINT)  # as the terminal does
        out = "".join(head) + proc.communicate(timeout=120)[0]
        took = time.monotonic() - t0
        rec = JobStore(home / "jobs.db").get(job)
        slurm_id = read_job_id(rec.run_dir)
        if how == "sigint-test-only":
            assert proc.returncode == 130 and rec.state == "CANCELLED" and "Ctrl-C" in rec.root_cause, (
                proc.returncode, rec.to_dict(), out[-3000:])
            assert slurm_id is None and not subprocess.run(["squeue", "-h", "--name", job], capture_output=True,
                                                           text=True).stdout.strip()
            print(f"Ctrl-C during the check: CANCELLED, exit after {took:.2f} s")
            assert took < 2.0, f"the check (its shim sleeping 3 s included) was not stopped at once: {took:.2f} s"
            return
        assert slurm_id, f"sbatch was interrupted: nothing submitted, or a job nobody records\n{out}"
        if how == "sigint":
            assert proc.returncode == 130 and rec.state == "CANCELLED" and "Ctrl-C" in rec.root_cause, (
                proc.returncode, rec.to_dict(), out[-3000:])
            # stopped: scancelled while queued, or (started meanwhile) its nodes stopped, the step failing
            ended = wait_until(lambda: (lambda st: st if st.split()[:1] in (["CANCELLED"], ["FAILED"]) else None)(
                sacct_state(slurm_id)), 60, "SLURM to record the job's end")
            print(f"Ctrl-C while sbatch ran: CANCELLED, SLURM job {slurm_id} {ended}")
        else:
            assert proc.returncode == 129, rec.to_dict()

            def final():
                r = subprocess.run([*cli, "status", job, "--json"], cwd=REPO, env=env, capture_output=True,
                                   text=True)
                state = json.loads(r.stdout)["state"]
                return state if state in ("COMPLETED", "FAILED", "CANCELLED") else None
            assert wait_until(final, 180, "the job to end") == "COMPLETED"
        assert wait_clean(10) == {}, node_namespace_leftovers()
    finally:  # whatever happened, nothing of it stays queued (the SLURM job's name is orchestrate's job id)
        subprocess.run(["scancel", "--name", job], capture_output=True, timeout=30)

"""Own code under a SLURM requeue (issue #12): a user's Hugging Face Trainer script that never imports orchestrate
(tests/slurm/user_trainer_requeue.py: no checkpointing, no signal handling, `save_strategy="no"`) submitted as a
`run: {script: ...}` job on the 2-node testbed; `scontrol requeue` while it trains. The zero-code hooks must make the
ranks save a checkpoint on the signal, the requeued job resume from it (the second attempt starts at that step and
ends at max_steps), the job end COMPLETED with the requeue counted, and both attempts log into ONE tracker run (the
same WANDB_RUN_ID with WANDB_RESUME=allow in every rank's environment; no wandb package needed). Marked `slurm`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import jobrun
from helpers import heartbeats
from slurm_helpers import REPO, WORK, heartbeat_step, node_namespace_leftovers, wait_clean, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("user_trainer_requeue.py")
DATA = REPO / "recipes" / "data" / "sft_tiny.jsonl"
MAX_STEPS = 18
STEP_SLEEP_S = 0.2  # paces the steps (~5/s): the requeue lands mid-run, the resumed attempt is short
REQUEUE_AT = 3  # requeue once a rank reported this step (the first attempt has ~3 s of steps left)


def _said(text: str, tag: str) -> list[dict]:
    return [json.loads(m.group(1)) for m in re.finditer(rf"^(?:\[rank\d+\]: )?{tag} (\{{.*\}})$", text, re.MULTILINE)]


def test_user_trainer_script_scontrol_requeue_saves_resumes_one_tracker_run(slurm_cluster, tmp_path, job_guard):
    from orchestrator import api
    from orchestrator import running
    from launchers.slurm.launcher import SlurmLauncher
    from orchestrator.node.rundir import RunDir
    from recipes.tiny import resolve_model_path

    model = resolve_model_path("tiny-llama")
    out = Path(WORK) / f"out-own-requeue-{time.time_ns()}"  # on the filesystem every node shares
    job = tmp_path / "my_job.yaml"
    job.write_text(yaml.safe_dump({
        "run": {"script": str(SCRIPT), "args": [model, str(DATA), str(out), str(MAX_STEPS), str(STEP_SLEEP_S)]},
        "health": {"stall_timeout": 120, "startup_timeout": 300}}))
    prep = api.prepare(str(job), str(REPO / "cluster_configs" / "slurm_local.yaml"), nodes=2, cwd=tmp_path,
                       overrides=[f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}"])
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    job_guard.run_dir(run_dir)
    L = SlurmLauncher(prep.cluster)
    h = L.submit(L.prepare(prep.plan), RunDir(run_dir))
    slurm_id = h.handle.data["job_id"]
    try:
        t0 = time.monotonic()
        wait_until(lambda: heartbeat_step(run_dir) >= REQUEUE_AT, 180, 0.1, f"training to reach step {REQUEUE_AT}")
        subprocess.run(["scontrol", "requeue", slurm_id], check=True, timeout=30)
        t_requeue = time.monotonic() - t0
        res = jobrun.watch(h, prep.plan, timeout=400)
        took = time.monotonic() - t0
        logs = {r: RunDir(run_dir).log(r).read_text(errors="replace") for r in (0, 1)}
        text = logs[0] + "\n" + logs[1]  # every attempt's output: the agents append to RUN_DIR/logs/node<R>.log
        print(f"own code SLURM requeue: requeued at {t_requeue:.1f}s, {res.state} after {took:.1f}s")
        assert res.state == "COMPLETED", res.root_cause + "\n" + text[-4000:]
    finally:
        if not L.query(h.handle)["terminal"]:
            L.cancel(h.handle)

    # 1. the ranks saved a checkpoint on the signal (the script saves none itself: save_strategy="no")
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "optimizer.pt").exists(), (ckpts, text[-4000:])
    saved = int(ckpts[0].name.split("-")[1])
    assert REQUEUE_AT <= saved < MAX_STEPS, saved
    for rank in (0, 1):
        recs = heartbeats(run_dir, rank)
        events = [(r["event"], r["step"]) for r in recs]
        assert ("save", saved) in events and ("preempted", saved) in events, events
        starts = [r["step"] for r in recs if r["event"] == "start"]
        assert starts == [0, saved], events  # two attempts: the second one started from the save
        after = [r["step"] for r in recs[[r["event"] for r in recs].index("preempted"):] if r["event"] == "step"]
        assert after and after[0] == saved + 1 and after[-1] == MAX_STEPS, events  # resumed, ran to the end
        assert recs[-1]["event"] == "end" and recs[-1]["step"] == MAX_STEPS, events

    # 2. what the script itself saw: attempt 0 from step 0, attempt 1 (SLURM_RESTART_COUNT=1) from the save
    begins = _said(text, "USER_BEGIN")
    assert sorted((b["restart"], b["rank"], b["global_step"]) for b in begins) == \
        [(0, 0, 0), (0, 1, 0), (1, 0, saved), (1, 1, saved)], begins
    firsts = {(f["restart"], f["rank"]): f["global_step"] for f in _said(text, "USER_FIRST_STEP")}
    assert firsts[(1, 0)] == firsts[(1, 1)] == saved + 1 > REQUEUE_AT, firsts
    done = _said(text, "USER_DONE")
    assert sorted((d["restart"], d["rank"], d["global_step"]) for d in done) == [(1, 0, MAX_STEPS),
                                                                                 (1, 1, MAX_STEPS)], done

    # 3. the requeue is counted: by SLURM and in the run dir, with its reason
    assert L.query(h.handle)["restarts"] >= 1
    attempts = RunDir(run_dir).attempts()
    assert running.restart_count(RunDir(run_dir)) >= 1, attempts
    assert any("requeued by SLURM" in a.reason for a in attempts), attempts

    # 4. ONE tracker run: every rank sees the same W&B run id (resume allowed, grouped by the job) on both attempts
    envs = _said(text, "USER_ENV")
    assert sorted((e["restart"], e["rank"]) for e in envs) == [(0, 0), (0, 1), (1, 0), (1, 1)], envs
    assert {e["job"] for e in envs} == {slurm_id} and {e["world"] for e in envs} == {2}, envs
    for rank in (0, 1):
        mine = [e for e in envs if e["rank"] == rank]
        assert len({e["WANDB_RUN_ID"] for e in mine}) == 1 and mine[0]["WANDB_RUN_ID"], mine
        assert {e["WANDB_RESUME"] for e in mine} == {"allow"}, mine
        assert {e["WANDB_RUN_GROUP"] for e in mine} == {prep.plan.job_id}, mine
    run0 = {e["WANDB_RUN_ID"] for e in envs if e["rank"] == 0}.pop()
    assert run0.startswith(re.sub(r"[^A-Za-z0-9_-]", "-", prep.plan.job_id)[:20]), run0  # the job's run
    assert wait_clean(10) == {}, node_namespace_leftovers()
    shutil.rmtree(out, ignore_errors=True)  # kept when the test fails

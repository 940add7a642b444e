"""Sweeps on the real SLURM testbed (issue #27 part 1): a sweep is ONE array job (`sbatch --array=0-N%P`), every
array task a full 2-node job of its own (its own allocation, main address and rendezvous port), at most P running at
once (from SLURM's own accounting and from the node agents' records); every point an ordinary job in the store (record,
run dir, output dir, state) that `orchestrate sweep`, `status` and `cancel` know. All marked `slurm`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV
from slurm_helpers import REPO, WORK, node_namespace_leftovers, wait_clean, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]
SFT = REPO / "recipes" / "configs" / "sft_tiny.yaml"
CLUSTER = REPO / "cluster_configs" / "slurm_local.yaml"
CLI = [sys.executable, "-m", "orchestrator.cli"]


def _env(tmp_path: Path, bin_dir: Path) -> dict[str, str]:
    return dict(os.environ, **OFFLINE_ENV, ORCHESTRATE_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1",
                PATH=f"{bin_dir}:{os.environ['PATH']}")


def _sbatch_shim(tmp_path: Path) -> tuple[Path, Path]:
    """An `sbatch` on PATH that logs every call (argv and the script's #SBATCH lines), then runs the real one."""
    real, bin_dir, log = shutil.which("sbatch"), tmp_path / "bin", tmp_path / "sbatch-calls.log"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"""#!/bin/sh
for last in "$@"; do :; done
{{ echo "CALL $*"; grep '^#SBATCH' "$last"; }} >> {log}
exec {real} "$@"
""")
    (bin_dir / "sbatch").chmod(0o755)
    return bin_dir, log


def _submit_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["submit", str(SFT), "--nodes", "2", "--cluster", str(CLUSTER), "--quiet",
            f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}",
            f"trainer.output_dir={tmp_path / 'out'}", *extra]


def _attached(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    """An attached `orchestrate submit --sweep ...` in a session of its own, its output on a pipe."""
    return subprocess.Popen([*CLI, *_submit_args(tmp_path, *extra)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _read_until(proc: subprocess.Popen, until) -> tuple[list[str], str]:
    """The runner's lines up to the first that `until` accepts, and the sweep id they printed."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if until(line):
            break
    return lines, re.search(r"^sweep (sweep-\S+): \d+ point", "".join(lines), re.M).group(1)


def _sacct(array: str) -> list[dict[str, str]]:
    r = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array, "-o", "JobID,State,Start,End,NodeList"],
                       capture_output=True, text=True, timeout=30)
    keys = ("job", "state", "start", "end", "nodes")
    return [dict(zip(keys, line.split("|"), strict=True)) for line in r.stdout.splitlines() if line.strip()]


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most spans [start, end) that hold one instant (checked at every start)."""
    return max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)


def test_a_sweep_is_one_array_job_two_tasks_at_a_time(slurm_cluster, tmp_path):
    bin_dir, calls = _sbatch_shim(tmp_path)
    env = _env(tmp_path, bin_dir)
    t0 = time.monotonic()
    p = subprocess.run([*CLI, *_submit_args(tmp_path, "trainer.max_steps=6", "--sweep",
                                            "trainer.learning_rate=1e-4,3e-3", "--sweep", "trainer.seed=1,2",
                                            "--max-parallel", "2")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    sid = re.search(r"^sweep (sweep-\S+): \d+ point", out, re.M).group(1)
    doc = json.loads((tmp_path / "home" / "sweeps" / f"{sid}.json").read_text())
    array = doc["slurm_array"]

    # ONE sbatch (besides its --test-only check), of the array script: 4 tasks, at most 2 at once
    log = calls.read_text()
    submits = [c for c in log.split("CALL ")[1:] if not c.startswith("--test-only")]
    assert len(submits) == 1, log
    assert "#SBATCH --array=0-3%2" in submits[0], submits[0]
    assert "#SBATCH --array=0-3%2" in Path(doc["sbatch"]).read_text().splitlines()

    # SLURM's own records: the array's 4 tasks, all COMPLETED, never more than 2 running at once (and 2 did)
    rows = wait_until(lambda: (lambda r: r if len(r) == 4 and all(x["end"] not in ("", "Unknown") for x in r)
                               else None)(_sacct(array)), 60, "sacct to hold the array's 4 tasks")
    assert sorted(r["job"] for r in rows) == [f"{array}_{i}" for i in range(4)], rows
    assert {r["state"] for r in rows} == {"COMPLETED"}, rows
    spans = [(datetime.fromisoformat(r["start"]).timestamp(), datetime.fromisoformat(r["end"]).timestamp())
             for r in rows]
    assert _most_at_once(spans) == 2, rows

    # ... and the node agents' own records (sub-second): each point's 2 nodes, from agent start to exit
    agent_spans, ports = [], set()
    for pt in doc["points"]:
        rd = Path(pt["run_dir"])
        agents = [json.loads((rd / "nodes" / str(n) / "agent.json").read_text()) for n in (0, 1)]
        ends = [json.loads((rd / "nodes" / str(n) / "exit.json").read_text()) for n in (0, 1)]
        assert [a["node_rank"] for a in agents] == [0, 1] and len({a["main_ip"] for a in agents}) == 1, agents
        agent_spans.append((min(a["started"] for a in agents), max(e["time"] for e in ends)))
        ports.add((rd / "nodes" / "0" / "accelerate.yaml").read_text().split("main_process_port: ")[1].split()[0])
    assert _most_at_once(agent_spans) <= 2, agent_spans
    assert ports == {"29501", "29502", "29503", "29504"}, ports  # task i: launch.port + 1 + i (tasks share nodes)

    # every point an ordinary job: its record (state, the task's handle), run dir, output dir
    for i, pt in enumerate(doc["points"]):
        st = json.loads(subprocess.run([*CLI, "status", pt["job_id"], "--json"], cwd=REPO, env=env,
                                       capture_output=True, text=True, timeout=60).stdout)
        assert st["state"] == "COMPLETED" and st["handle"] == f"slurm://{array}_{i}", st
        assert (tmp_path / "out" / pt["job_id"]).is_dir()
    table = json.loads(subprocess.run([*CLI, "sweep", sid, "--json"], cwd=REPO, env=env, capture_output=True,
                                      text=True, timeout=60).stdout)
    losses = [r["final_loss"] for r in table["points"]]
    assert all(isinstance(x, float) for x in losses) and losses == sorted(losses), table
    assert {r["state"] for r in table["points"]} == {"COMPLETED"} and {r["step"] for r in table["points"]} == {6}
    assert "trainer.learning_rate=3e-3" in table["points"][0]["overrides"], table
    print(f"SLURM sweep: 4 points x 2 nodes, array {array}, --max-parallel 2: {took:.1f} s; "
          f"losses {[round(x, 4) for x in losses]}")
    assert wait_clean(15) == {}, node_namespace_leftovers()


def test_cancel_of_a_slurm_sweep_scancels_the_array(slurm_cluster, tmp_path):
    """`orchestrate cancel SWEEP_ID`: the running task and the pending ones all end CANCELLED (SLURM's records and
    ours), the runner exits 130, nothing is left on the nodes."""
    bin_dir, _ = _sbatch_shim(tmp_path)
    env = _env(tmp_path, bin_dir)
    proc = _attached(tmp_path, env, "trainer.max_steps=100000", "--sweep", "trainer.seed=1,2,3", "--max-parallel", "1")
    array = None
    try:
        lines, sid = _read_until(proc, lambda line: "progress: step" in line or "loss" in line)
        doc = json.loads((tmp_path / "home" / "sweeps" / f"{sid}.json").read_text())
        array = doc["slurm_array"]
        c = subprocess.run([*CLI, "cancel", sid], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert c.returncode == 0, c.stdout + c.stderr
        rest = proc.communicate(timeout=120)[0]
        assert proc.returncode == 130, "".join(lines) + rest
        states = [json.loads(subprocess.run([*CLI, "status", pt["job_id"], "--json"], cwd=REPO, env=env,
                                            capture_output=True, text=True, timeout=60).stdout)["state"]
                  for pt in doc["points"]]
        assert states == ["CANCELLED"] * 3, (states, c.stdout, rest[-3000:])
        # (tasks cancelled before they started may be one row of the array's pending part, `A_[1-2%1]`)
        wait_until(lambda: (lambda r: r and all(x["state"].startswith("CANCELLED") for x in r))(_sacct(array)), 60,
                   "SLURM to record every task CANCELLED")
        assert not subprocess.run(["squeue", "-h", "-j", array], capture_output=True, text=True).stdout.strip()
        assert wait_clean(15) == {}, node_namespace_leftovers()
    finally:
        if proc.poll() is None:
            proc.kill()
        if array:
            subprocess.run(["scancel", array], capture_output=True, timeout=30)


def test_an_attached_sweep_survives_its_terminal_hanging_up_and_attach_follows_it(slurm_cluster, tmp_path):
    """SIGHUP to an attached SLURM sweep's runner (its terminal went away) cancels nothing: the array runs on, the
    runner's output moves to the sweep's log, `attach SWEEP_ID` follows it to the end, every point COMPLETED."""
    bin_dir, _ = _sbatch_shim(tmp_path)
    env = _env(tmp_path, bin_dir)
    proc = _attached(tmp_path, env, "trainer.max_steps=4", "--sweep", "trainer.seed=1,2", "--max-parallel", "2")
    array = None
    try:
        lines, sid = _read_until(proc, lambda line: "SLURM array job" in line)
        array = json.loads((tmp_path / "home" / "sweeps" / f"{sid}.json").read_text())["slurm_array"]
        os.kill(proc.pid, signal.SIGHUP)
        att = subprocess.run([*CLI, "attach", sid], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        assert att.returncode == 0, att.stdout + att.stderr
        assert proc.wait(60) == 0, "".join(lines)
        assert "the submitting terminal hung up (SIGHUP): the array keeps running" in att.stdout, att.stdout[-3000:]
        doc = json.loads((tmp_path / "home" / "sweeps" / f"{sid}.json").read_text())
        states = [json.loads(subprocess.run([*CLI, "status", pt["job_id"], "--json"], cwd=REPO, env=env,
                                            capture_output=True, text=True, timeout=60).stdout)["state"]
                  for pt in doc["points"]]
        assert states == ["COMPLETED"] * 2 and doc.get("hung_up"), (states, att.stdout[-3000:])
        assert wait_clean(15) == {}, node_namespace_leftovers()
    finally:
        if proc.poll() is None:
            proc.kill()
        if array:
            subprocess.run(["scancel", array], capture_output=True, timeout=30)


def test_each_array_task_has_its_own_requeue_budget(slurm_cluster):
    """Two points as one array (the launcher's submit_array, trivial payload): USR2 to both tasks (SLURM's preemption
    notice). p0 (health.max_restarts 1) saves, is requeued and resumes from its save to the end; p1 (budget 0) saves
    and is not requeued: the budget is each task's own (its SLURM_RESTART_COUNT, its restarts.jsonl)."""
    from dataclasses import replace

    import jobrun
    from launchers.slurm.launcher import SlurmLauncher
    from launchers.slurm.sbatch import render_array_sbatch
    from orchestrator.core.health import HealthSpec
    from orchestrator.node.rundir import RunDir
    from slurm_helpers import heartbeat_step, local_cluster, trivial_plan
    cluster = local_cluster()
    launcher = SlurmLauncher(cluster)
    plans = []
    for i, budget in enumerate((1, 0)):
        plan = trivial_plan(f"arr{i}", ["60", "--sleep", "0.1", "--save-dir", "CKPT"])
        ckpt = str(Path(plan.run_dir) / "ckpt")
        plan = replace(plan, health=HealthSpec(max_restarts=budget), node_plans=tuple(
            replace(n, command=tuple(ckpt if a == "CKPT" else a for a in n.command)) for n in plan.node_plans))
        (Path(plan.run_dir) / "plan.json").write_text(plan.to_json())
        plans.append(plan)
    folder = WORK / "sweeps" / f"arr-{time.time_ns()}"
    script = render_array_sbatch([(p, cluster.slurm) for p in plans], 2, folder.name, str(folder))
    array, handles = launcher.submit_array([launcher.prepare(p) for p in plans], [RunDir(p.run_dir) for p in plans],
                                           parallel=2, name=folder.name, folder=folder, script=script)
    try:
        assert [h.uri for h in handles] == [f"slurm://{array}_0", f"slurm://{array}_1"]
        for p in plans:
            wait_until(lambda p=p: heartbeat_step(p.run_dir) >= 10, 90, "both tasks at step 10")
        for h in handles:
            subprocess.run(["scancel", "--signal=USR2", h.data["job_id"]], check=True)
        results = [jobrun.watch(launcher.adopt(h, RunDir(p.run_dir)), p, timeout=180)
                   for h, p in zip(handles, plans, strict=True)]
        decisions = [[json.loads(x)["decision"] for x in (Path(p.run_dir) / "restarts.jsonl").read_text().splitlines()]
                     for p in plans]
        assert decisions[0] == ["restart"] and "restart" not in decisions[1], decisions
        log0 = (Path(plans[0].run_dir) / "logs" / "node0.log").read_text()
        assert "payload: resumed from step" in log0 and "payload: node 0 done at step 60" in log0, log0[-2000:]
        assert results[0].state == "COMPLETED", results[0]
        assert "payload: node 0 done" not in (Path(plans[1].run_dir) / "logs" / "node0.log").read_text()
        assert [launcher.query(h)["restarts"] for h in handles] == [1, 0]
    finally:
        subprocess.run(["scancel", array], capture_output=True, timeout=30)
    assert wait_clean(15) == {}, node_namespace_leftovers()


def test_a_rendered_sweep_runs_by_hand_with_plain_sbatch(slurm_cluster, tmp_path):
    """issue #37 item 4: `orchestrate render JOB --sweep ... --out DIR` then a user's own `sbatch DIR/job.sbatch` runs
    every point (array task i on DIR/p<i>, its own output dir), with no orchestrate process watching."""
    env = _env(tmp_path, Path("/usr/bin"))
    out = WORK / f"render-sweep-{time.time_ns()}"
    r = subprocess.run([*CLI, "render", str(SFT), "--nodes", "2", "--cluster", str(CLUSTER), "--out", str(out),
                        f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}",
                        f"trainer.output_dir={out / 'outputs'}", "trainer.max_steps=3", "--sweep", "trainer.seed=1,2"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    sb = subprocess.run(["sbatch", "--parsable", str(out / "job.sbatch")], capture_output=True, text=True, cwd="/",
                        timeout=60)
    assert sb.returncode == 0, sb.stderr
    array = sb.stdout.strip().split(";")[0]
    try:
        rows = wait_until(lambda: (lambda r: r if len(r) == 2 and all(x["end"] not in ("", "Unknown") for x in r)
                                   else None)(_sacct(array)), 300, 1.0, "the array's 2 tasks to end")
        assert {x["state"] for x in rows} == {"COMPLETED"}, (rows, [p.read_text()[-2000:] for p in
                                                                 out.glob("slurm-*.out")])
        doc = json.loads((out / "sweep.json").read_text())
        for i, pt in enumerate(doc["points"]):
            log = (out / f"p{i}" / "logs" / "node0.log").read_text()
            res = json.loads(log.split("ORCHESTRATE_RESULT ")[-1].splitlines()[0])
            assert res["global_step"] == 3 and res["world_size"] == 2, res
            assert res["output_dir"] == str(out / "outputs" / pt["job_id"]), res
    finally:
        subprocess.run(["scancel", array], capture_output=True, timeout=30)
    assert wait_clean(15) == {}, node_namespace_leftovers()

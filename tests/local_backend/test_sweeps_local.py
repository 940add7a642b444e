"""Sweeps on 2 local nodes (issue #27 part 1): a grid of points, each an ordinary job (own id, run dir, output dir),
every point planned before anything starts, at most --max-parallel running at once (checked from the node agents'
own start and end records), the table sorted by final loss; a point that diverges is stopped early with
--stop-if-worse; `orchestrate cancel SWEEP_ID` stops the sweep (running points CANCELLED, the rest never started)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, PYTHON, cli

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "recipes/configs/sft_tiny.yaml"
pytestmark = pytest.mark.slow


def _sweep_id(out: str) -> str:
    m = re.search(r"^sweep (sweep-\S+): \d+ point", out, re.M)
    assert m, out[-3000:]
    return m.group(1)


def _intervals(home: Path, job: str) -> list[tuple[float, float]]:
    rd = home / "runs" / job
    out = []
    for node in (0, 1):
        agent = json.loads((rd / "nodes" / str(node) / "agent.json").read_text())
        end = json.loads((rd / "nodes" / str(node) / "exit.json").read_text())
        out.append((agent["started"], end["time"]))
    return out


def test_a_grid_runs_two_at_a_time_and_the_table_is_sorted_by_loss(tmp_path, job_guard):
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": home, "OMP_NUM_THREADS": "1"}
    p = cli("submit", SFT, "--nodes", "2", "--sweep", "trainer.learning_rate=1e-4,3e-3", "--sweep", "trainer.seed=1,2",
            "--max-parallel", "2", "--quiet", "trainer.max_steps=6", f"trainer.output_dir={tmp_path / 'out'}",
            env=env, cwd=REPO, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    sid = _sweep_id(out)
    jobs = [f"{sid}-p{i}" for i in range(4)]
    spans = []
    for job in jobs:  # every point is a job of its own: record, run dir, output dir
        st = json.loads(cli("status", job, "--json", env=env).stdout)
        assert st["state"] == "COMPLETED", st
        assert (tmp_path / "out" / job / "model.safetensors").is_file() or list((tmp_path / "out" / job).iterdir())
        node_spans = _intervals(home, job)
        spans.append((min(s for s, _ in node_spans), max(e for _, e in node_spans)))
    # never more than 2 points at once: at every point's start, count the points running
    for start, _ in spans:
        running = sum(1 for s, e in spans if s <= start < e)
        assert running <= 2, spans
    assert max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans) == 2, spans  # and 2 did overlap
    table = json.loads(cli("sweep", sid, "--json", env=env).stdout)
    losses = [r["final_loss"] for r in table["points"]]
    assert all(isinstance(x, float) for x in losses) and losses == sorted(losses), table
    assert {r["state"] for r in table["points"]} == {"COMPLETED"} and table["max_parallel"] == 2
    best = table["points"][0]
    assert "trainer.learning_rate=3e-3" in best["overrides"], table  # the larger rate learns faster in 6 steps
    text = cli("sweep", sid, env=env).stdout
    assert text.splitlines()[1].split()[:5] == ["POINT", "STATE", "STEP", "FINAL", "BEST"], text
    # `ls` groups the sweep: a header line, then its points in order, each with its overrides and last loss
    ls = cli("ls", "--color", "never", env=env).stdout.splitlines()
    head = next(i for i, ln in enumerate(ls) if ln.startswith(sid))
    assert "sweep of 4 point(s), at most 2 at once: 4 COMPLETED" in ls[head], ls
    assert [ln.split()[0] for ln in ls[head + 1:head + 5]] == jobs, ls
    assert all("trainer.learning_rate=" in ln and " loss " in ln for ln in ls[head + 1:head + 5]), ls
    rows = json.loads(cli("ls", "--json", env=env).stdout)
    assert {r["id"]: (r["sweep"], r["point"]) for r in rows} == {j: (sid, i) for i, j in enumerate(jobs)}, rows
    # `plot SWEEP_ID`: the points' loss curves on one PNG
    png = cli("plot", sid, "--out", tmp_path / "sweep.png", env=env)
    assert png.returncode == 0 and (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG", png.stderr


def test_a_bad_point_is_named_and_nothing_is_submitted(tmp_path, job_guard):
    home = job_guard.home(tmp_path / "home")
    p = cli("submit", SFT, "--nodes", "2", "--sweep", "trainer.learning_rate=1e-3,fast", "--sweep", "trainer.seed=1",
            env={"ORCHESTRATE_HOME": home}, cwd=REPO, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert ("point p1 (trainer.learning_rate=fast trainer.seed=1): trainer.learning_rate: must be a number, got "
            "'fast'") in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (home / "runs").exists() or not list((home / "runs").iterdir())
    for bad, message in ((["--sweep", "trainer.seed"], "--sweep trainer.seed: must be one of KEY=a,b,c | KEY=[a,b,c]"),
                         (["--sweep", "trainer.seed=1,,2"], "an empty value"),
                         (["--sweep", "trainer.seed=1", "--sweep", "trainer.seed=2"], "trainer.seed is swept twice"),
                         (["--max-parallel", "2"], "--max-parallel: only with --sweep"),
                         (["--sweep", "trainer.seed=1,2", "--max-parallel", "0"], "--max-parallel: must be an")):
        p = cli("submit", SFT, *bad, env={"ORCHESTRATE_HOME": home}, cwd=REPO, timeout=120)
        assert p.returncode == 2 and message in p.stderr, (bad, p.stderr)


def test_a_diverging_point_is_stopped_early(tmp_path, job_guard):
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": home, "OMP_NUM_THREADS": "1"}
    p = cli("submit", SFT, "--nodes", "2", "--sweep", "trainer.learning_rate=3e-3,50", "--stop-if-worse", "1.5",
            "--quiet", "trainer.max_steps=200", "trainer.logging_steps=1", "trainer.save_steps=1000",
            f"trainer.output_dir={tmp_path / 'out'}", env=env, cwd=REPO, timeout=900)
    out = p.stdout + p.stderr
    p1 = "\n".join(line for line in out.splitlines() if line.startswith("[p1]") or "p1 " in line)
    assert p.returncode == 0, p1[-3000:] + out[-2000:]
    sid = _sweep_id(out)
    assert f"sweep {sid}: p1 stopped early: " in out, p1[-3000:] + out[-2000:]
    table = {r["point"]: r for r in json.loads(cli("sweep", sid, "--json", env=env).stdout)["points"]}
    assert table["p0"]["state"] == "COMPLETED" and table["p0"]["step"] == 200, table
    assert table["p1"]["state"] == "CANCELLED" and table["p1"]["stopped_early"], table
    assert table["p1"]["step"] < 200 and f"stopped early by sweep {sid}: " in table["p1"]["root_cause"], table


def test_cancel_of_a_sweep_stops_the_running_points_and_starts_no_more(tmp_path, job_guard):
    home = job_guard.home(tmp_path / "home")
    env = {**OFFLINE_ENV, "ORCHESTRATE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    runner = subprocess.Popen([PYTHON, "-m", "orchestrator.cli", "submit", str(SFT), "--nodes", "2", "--sweep",
                               "trainer.seed=1,2,3", "--max-parallel", "2", "--quiet", "trainer.max_steps=100000",
                               f"trainer.output_dir={tmp_path / 'out'}"], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    job_guard.proc(runner)
    seen, sid, training = "", None, set()
    deadline = time.monotonic() + 300
    assert runner.stdout is not None
    while time.monotonic() < deadline and len(training) < 2:
        line = runner.stdout.readline()
        seen += line
        sid = sid or (re.search(r"^sweep (sweep-\S+): \d+ point", line) or [None, None])[1]
        if "progress: step" in line:  # p0 and p1 train
            training.add(line.split()[0])
    assert sid and len(training) == 2, seen[-3000:]
    c = cli("cancel", sid, env={"ORCHESTRATE_HOME": home}, timeout=120)
    assert c.returncode == 0 and f"job {sid}-p0 CANCELLED" in c.stdout, c.stdout + c.stderr
    assert f"job {sid}-p1 CANCELLED" in c.stdout and f"job {sid}-p2 NOT STARTED" in c.stdout, c.stdout
    rest, _ = runner.communicate(timeout=120)
    assert runner.returncode == 130, (seen + rest)[-3000:]
    table = {r["point"]: r["state"] for r in json.loads(cli("sweep", sid, "--json", env=env).stdout)["points"]}
    assert table == {"p0": "CANCELLED", "p1": "CANCELLED", "p2": "NOT STARTED"}, table
    causes = {json.loads(cli("status", f"{sid}-p{i}", "--json", env=env).stdout)["root_cause"] for i in (0, 1)}
    assert causes == {f"sweep {sid} was cancelled: by the user (orchestrate cancel {sid})"}, causes  # one, the sweep's


def test_a_detached_sweep_from_the_job_files_sweep_block_runs_on_and_attach_follows_it(tmp_path, job_guard):
    """`submit job.yaml --detach` of a file with a `sweep:` block: every point planned, the runner started in the
    background, the submit returns at once; `attach SWEEP_ID` prints the runner's output to the end, then the table."""
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": home, "OMP_NUM_THREADS": "1"}
    job = tmp_path / "job.yaml"
    job.write_text(SFT.read_text() + "\nsweep:\n  grid: {trainer.seed: [1, 2]}\n  max_parallel: 1\n")
    t0 = time.monotonic()
    p = cli("submit", job, "--nodes", "2", "--detach", "--quiet", "trainer.max_steps=4",
            f"trainer.output_dir={tmp_path / 'out'}", env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0 and "runs detached" in p.stdout, p.stdout + p.stderr
    sid = re.search(r"^sweep (sweep-\S+): 2 point", p.stdout, re.M).group(1)
    doc = json.loads((Path(home) / "sweeps" / f"{sid}.json").read_text())
    job_guard.proc(int(doc["runner_pid"]))
    assert [pt["overrides"] for pt in doc["points"]] == [["trainer.seed=1"], ["trainer.seed=2"]]
    returned = time.monotonic() - t0
    follow = job_guard.proc(subprocess.Popen(  # `logs -f SWEEP_ID` from the start, while attach follows the runner
        [PYTHON, "-m", "orchestrator.cli", "logs", sid, "-f"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, **OFFLINE_ENV, **env, "ORCHESTRATE_HOME": str(home)}))
    a = cli("attach", sid, env=env, timeout=600)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr
    assert f"attached to sweep {sid}" in a.stdout and "[p0]" in a.stdout and "[p1]" in a.stdout, a.stdout[-3000:]
    table = a.stdout.splitlines()[-3:]
    assert table[0].split()[:2] == ["POINT", "STATE"] and all(" COMPLETED " in ln for ln in table[1:]), table
    assert returned < time.monotonic() - t0 - 10, (returned, time.monotonic() - t0)  # submit did not wait for it
    states = {r["point"]: r["state"] for r in json.loads(cli("sweep", sid, "--json", env=env).stdout)["points"]}
    assert states == {"p0": "COMPLETED", "p1": "COMPLETED"}, states
    # `logs -f SWEEP_ID` followed every point to the end, each line prefixed [p<i>] (issue #37 item 9) ...
    lines = follow.communicate(timeout=60)[0].splitlines()
    assert follow.returncode == 0, lines[-20:]
    for i in (0, 1):
        assert any(ln.startswith(f"[p{i}] [") and "rank1]" in ln for ln in lines), lines[-20:]
    # ... and `status SWEEP_ID` is the sweep's table, `logs SWEEP_ID --rank R` each point's rank R
    st = json.loads(cli("status", sid, "--json", env=env).stdout)
    assert {r["point"]: r["state"] for r in st["points"]} == states, st
    assert cli("status", sid, env=env).stdout.splitlines()[1].split()[:2] == ["POINT", "STATE"]
    ranks = cli("logs", sid, "--rank", "1", env=env).stdout.splitlines()
    assert ranks and all(re.match(r"\[p[01]\] \[\S+ node1 rank1\]", ln) for ln in ranks), ranks[:5]

"""No silent resume of another job's checkpoint (issue #28), through the CLI on the local backend with real training:
job A writes checkpoints (each with its orchestrate.json); job B on the same output dir is refused before anything
starts (exit 2, one line naming the checkpoint, job A and the step, and the ways out); with checkpoint.resume=latest
it continues from A's checkpoint and says so, in the submit output and in `status`. A restart of one job (same id,
checkpoint.resume: auto) still resumes from its own checkpoint, unannounced."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, OFFLINE_ENV, cli, saved_rank, wait_until

REPO = Path(__file__).resolve().parents[2]


def _result(stdout: str) -> dict:
    m = re.search(r"^\[\S+ node0 rank0\] ORCHESTRATE_RESULT (\{.*\})$", stdout, re.MULTILINE)
    return json.loads(m.group(1)) if m else {}


def _completed(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = re.search(r"^job (\S+) COMPLETED", r.stdout, re.MULTILINE)
    assert m, r.stdout[-3000:]
    return m.group(1)


def _record(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "orchestrate.json").read_text())


@pytest.mark.slow
def test_a_new_job_is_refused_another_jobs_checkpoints_unless_it_asks(tmp_path, job_guard):
    home, out = tmp_path / "home", tmp_path / "out"
    job_guard.home(home)
    env = {"ORCHESTRATE_HOME": str(home)}
    base = ["submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "trainer.save_strategy=steps",
            "trainer.save_steps=2", f"trainer.output_dir={out}"]

    a = _completed(cli(*base, "trainer.max_steps=4", env=env, cwd=REPO, timeout=600))
    for step in (2, 4):  # every checkpoint records the job that wrote it
        rec = _record(out / f"checkpoint-{step}")
        assert rec["job_id"] == a and rec["step"] == step, rec

    b = cli(*base, "trainer.max_steps=6", env=env, cwd=REPO, timeout=120)
    assert b.returncode == 2, b.stdout[-3000:] + b.stderr[-3000:]
    lines = b.stderr.strip().splitlines()
    assert len(lines) == 1, b.stderr
    line = lines[0]
    assert line.startswith("orchestrate: error: ") and f"checkpoint-4 of job {a} (step 4) in {out}" in line, line
    assert f"checkpoint.resume: latest (or checkpoint.resume: {out / 'checkpoint-4'})" in line, line
    assert "another output dir (trainer.output_dir)" in line, line
    # nothing started: no plan printed, no run dir, no record but A's, and A's checkpoints untouched
    assert b.stdout == "", b.stdout
    assert [d.name for d in (home / "runs").iterdir()] == [a]
    assert [j["id"] for j in json.loads(cli("ls", "--json", env=env).stdout)] == [a]
    assert sorted(d.name for d in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]

    c = cli(*base, "trainer.max_steps=6", "checkpoint.resume=latest", env=env, cwd=REPO, timeout=600)
    job_c = _completed(c)
    said = f"resuming from checkpoint-4 of job {a} (step 4): {out / 'checkpoint-4'} (checkpoint.resume: latest)"
    assert said in c.stdout.splitlines(), c.stdout[:3000]
    res = _result(c.stdout)
    assert res["resumed_from"] == str(out / "checkpoint-4") and res["global_step"] == 6, res
    assert f"orchestrate recipe: resuming from {out / 'checkpoint-4'}: a checkpoint of job {a}" in c.stdout  # rank 0
    assert _record(out / "checkpoint-6")["job_id"] == job_c  # what C writes is C's
    assert _record(out / "checkpoint-4")["job_id"] == a
    status = cli("status", job_c, env=env)
    assert status.returncode == 0, status.stderr
    assert f"resumed from checkpoint-4 of job {a} (step 4): {out / 'checkpoint-4'}" in status.stdout.splitlines(), \
        status.stdout
    st = json.loads(cli("status", job_c, "--json", env=env).stdout)
    assert st["resumed_from"] == {"path": str(out / "checkpoint-4"), "job": a, "step": 4}, st["resumed_from"]
    assert json.loads(cli("status", a, "--json", env=env).stdout)["resumed_from"] is None
    assert "resumed" not in cli("status", a, env=env).stdout


@pytest.mark.slow
def test_a_restart_of_the_same_job_resumes_its_own_checkpoint(tmp_path, job_guard):
    """checkpoint.resume: auto (the default), max_restarts 1: rank 1 is killed after a checkpoint; the restart goes on
    from the job's own checkpoint (its orchestrate.json names the job), with no refusal and no announcement. A newer
    checkpoint whose save was cut short (what a rank SIGKILLed while saving leaves: a partial weights file, no
    trainer_state.json) is passed over, not resumed from (which failed the restart with FileNotFoundError)."""
    home, out = tmp_path / "home", tmp_path / "out"
    job_guard.home(home)
    argv = [PYTHON, "-m", "orchestrator.cli", "submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2",
            "trainer.max_steps=150", "trainer.save_strategy=steps", "trainer.save_steps=3", "trainer.logging_steps=1",
            "health.max_restarts=1", f"trainer.output_dir={out}"]
    p = job_guard.spawn(argv, cwd=REPO, env={**os.environ, **OFFLINE_ENV, "ORCHESTRATE_HOME": str(home)},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir, pid = saved_rank(home, 1, 3)
    job = run_dir.name
    wait_until(lambda: (out / "checkpoint-3" / "orchestrate.json").is_file(), 30, 0.05, "the checkpoint's record")
    cut = out / "checkpoint-149"  # (no save of this run writes it: save_steps 3)
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"\0" * 100)
    os.kill(pid, signal.SIGKILL)
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 0, text[-4000:]
    assert f"orchestrate: {cut} is incomplete (its save was cut short" in text, text[-4000:]
    assert re.search(rf"^job {job}: restart 1/1 from the latest checkpoint", text, re.MULTILINE), text[-4000:]
    res = _result(text)
    m = re.search(r"checkpoint-(\d+)$", str(res.get("resumed_from")))
    assert m and int(m.group(1)) >= 3 and res["global_step"] == 150, res
    assert _record(Path(res["resumed_from"]))["job_id"] == job
    assert f"orchestrate recipe: resuming from {res['resumed_from']}\n" in text  # rank 0's log: no other job named
    assert "a checkpoint of job" not in text and not re.search(r"^resuming from", text, re.MULTILINE)
    assert "resumed from" not in cli("status", job, env={"ORCHESTRATE_HOME": str(home)}).stdout

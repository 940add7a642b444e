"""Real training through the CLI on the local backend: the README's demo (one node) and a 2-node run whose
gradients are proven synced (same parameters on every rank AND different first batches per rank), DPO on ZeRO-3,
and detach / attach / cancel.

Every test takes `job_guard`: whatever a failing test's job left (supervisor, agents, ranks) is killed at its end.
The CLI runs through helpers.cli / spawn: SIGINT and SIGTERM at their defaults in the child, however pytest was
started (a background `bash .ci/run &` ignores SIGINT, and that survives exec)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PYTHON, cli, wait_until
from orchestrator.node.proctools import marked


def submit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = cli("submit", "recipes/configs/sft_tiny.yaml", *args, f"trainer.output_dir={tmp_path / 'out'}", timeout=600)
    m = re.search(r"^\[\S+ node0 rank0\] ORCHESTRATE_RESULT (\{.*\})$", r.stdout, re.MULTILINE)
    return r, (json.loads(m.group(1)) if m else {})


@pytest.mark.slow
def test_demo_single_node_trains_and_reports(tmp_path, job_guard):
    r, res = submit(tmp_path, "trainer.max_steps=12", "trainer.save_steps=6", "trainer.save_strategy=steps")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert res["world_size"] == 1 and res["global_step"] == 12
    assert res["final_loss"] < res["first_loss"]
    m = re.search(r"job \S+ COMPLETED: loss ([\d.]+) -> ([\d.]+) over 12 steps; checkpoint: (\S+)", r.stdout)
    assert m, r.stdout[-2000:]
    assert Path(m.group(3)).is_dir() and m.group(3).endswith("checkpoint-12")
    assert re.search(r"^progress: step \d+/12 \(\d+%\) \| loss [\d.]+ \| [\d,]+ tok/s", r.stdout, re.MULTILINE), \
        r.stdout[-2000:]


@pytest.mark.slow
def test_two_local_nodes_train_with_synced_gradients(tmp_path, job_guard):
    r, res = submit(tmp_path, "--nodes", "2", "trainer.max_steps=10")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world      2 node(s) x 1 process(es) = 2" in r.stdout
    assert res["world_size"] == 2 and res["global_step"] == 10
    ranks = res["ranks"]
    assert len({x["param_sha"] for x in ranks}) == 1, ranks  # every rank ends with the same parameters
    assert len({x["first_batch_sha"] for x in ranks}) == 2, ranks  # ...having seen different data
    assert res["final_loss"] < res["first_loss"]
    assert "[localhost node1 rank1]" in r.stdout


@pytest.mark.slow
@pytest.mark.deepspeed
def test_dpo_zero3_on_two_local_nodes(tmp_path, job_guard):
    r = cli("submit", "recipes/configs/dpo_tiny.yaml", "--nodes", "2", "--profile", "zero3", "trainer.max_steps=4",
            f"trainer.output_dir={tmp_path / 'out'}", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "profile    zero3 -> DEEPSPEED" in r.stdout
    m = re.search(r"^\[\S+ node0 rank0\] ORCHESTRATE_RESULT (\{.*\})$", r.stdout, re.MULTILINE)
    res = json.loads(m.group(1))
    assert res["world_size"] == 2 and res["global_step"] == 4
    # ZeRO-3: each rank holds half of the parameters
    assert all(x["local_param_numel"] < x["full_param_numel"] for x in res["ranks"]), res["ranks"]
    assert res["first_loss"] != res["final_loss"]


@pytest.mark.slow
@pytest.mark.health
def test_detach_attach_and_cancel(tmp_path, job_guard):
    """submit --detach returns with a job id while a supervisor runs the job; attach follows it and Ctrl-C only
    detaches; cancel from another process stops every process and records CANCELLED."""
    r = cli("submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--detach", "trainer.max_steps=100000",
            f"trainer.output_dir={tmp_path / 'out'}", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"^job (\S+) RUNNING \(supervisor pid \d+\); follow it with: orchestrate attach \1$", r.stdout,
                    re.MULTILINE)
    assert job, r.stdout
    job = job.group(1)
    att = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "attach", job], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = att.stdout.readline()
        lines.append(line)
        if line.startswith("progress: step") or not line:
            break
    assert any(x.startswith("progress: step") for x in lines), "".join(lines)
    att.send_signal(signal.SIGINT)
    out = att.communicate(timeout=30)[0]
    assert f"detached from job {job}; it keeps running" in out and att.returncode == 0, out
    status = json.loads(cli("status", job, "--json").stdout)
    assert status["state"] == "RUNNING" and status["ranks"], status
    tokens = [json.loads((Path(status["run_dir"]) / "nodes" / str(n) / "agent.json").read_text())["token"]
              for n in (0, 1)]
    assert all(marked(t) for t in tokens)
    c = cli("cancel", job, timeout=90)
    assert c.returncode == 0 and f"job {job} CANCELLED" in c.stdout, c.stdout + c.stderr
    wait_until(lambda: not any(marked(t) for t in tokens), 15, what="every process of the job to be gone")

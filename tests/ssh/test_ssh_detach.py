"""Detach and reattach over SSH, through the CLI: `submit --detach` returns at once while a supervisor holds the
SSH connections and monitors the job; `attach` follows its progress (Ctrl-C only detaches), a second `attach`
follows it to the end; status then shows every rank from the heartbeats forwarded over SSH (no shared
filesystem), and nothing of the job is left on any host."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import PYTHON, cli, live, supervisor_pid, wait_gone
from ssh_helpers import agent_info, remote_run_dir
from orchestrator.node.proctools import marked


@pytest.mark.slow
@pytest.mark.health
def test_detach_then_attach_over_ssh(testbed, tmp_path, job_guard):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(testbed.cluster()))
    home = job_guard.home(tmp_path / "home")
    env = {"ORCHESTRATE_HOME": str(home)}
    t0 = time.monotonic()
    r = cli("submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", cluster, "--detach",
            "trainer.max_steps=150", "trainer.logging_steps=1", f"trainer.output_dir={tmp_path / 'out'}", env=env,
            timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30, "submit --detach did not return promptly"
    m = re.search(r"^job (\S+) RUNNING \(supervisor pid (\d+)\)", r.stdout, re.MULTILINE)
    assert m, r.stdout
    job, supervisor = m.group(1), int(m.group(2))
    job_guard.run_dir(*(remote_run_dir(testbed, h, job) for h in testbed.hosts[:2]))  # no shared filesystem
    assert supervisor_pid(home, job) == supervisor

    att = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "attach", job], env={**os.environ, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = att.stdout.readline()
        lines.append(line)
        if line.startswith("progress: step") or not line:
            break
    assert any(x.startswith("progress: step") for x in lines), "".join(lines)
    att.send_signal(signal.SIGINT)  # spawn: SIGINT at its default in attach, even if pytest's is ignored
    out = att.communicate(timeout=30)[0]
    assert f"detached from job {job}; it keeps running" in out and att.returncode == 0, out
    tokens = [agent_info(testbed, h, job, n)["token"] for n, h in enumerate(testbed.hosts[:2])]
    assert all(marked(t) for t in tokens), "detaching the viewer stopped the job"

    fin = cli("attach", job, env=env, timeout=300)
    assert fin.returncode == 0, fin.stdout[-3000:] + fin.stderr[-3000:]
    assert "COMPLETED" in fin.stdout, fin.stdout[-3000:]
    st = json.loads(cli("status", job, "--json", env=env, timeout=60).stdout)
    assert st["state"] == "COMPLETED", st
    ranks = {r["rank"]: r for r in st["ranks"]}
    assert set(ranks) == {0, 1} and all(r["step"] == 150 for r in ranks.values()), st["ranks"]
    local = Path(st["run_dir"])
    assert (local / "heartbeats" / "rank1.jsonl").exists()  # forwarded over SSH, no shared filesystem
    wait_gone(lambda: live([supervisor]) + [p for t in tokens for p in marked(t)], timeout=10)

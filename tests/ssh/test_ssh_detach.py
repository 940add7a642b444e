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
import sys
import time
from pathlib import Path

import pytest
import yaml

from ssh_helpers import REPO, agent_info
from orchestrator.node.proctools import marked


@pytest.mark.slow
@pytest.mark.health
def test_detach_then_attach_over_ssh(testbed, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"kind": "ssh", "name": "testlab", "accelerator": "cpu",
                                       "network_interface": "lo", "ssh": testbed.ssh_block(hosts=testbed.hosts[:2])}))
    env = dict(os.environ, ORCHESTRATE_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    cli = [sys.executable, "-m", "orchestrator.cli"]
    t0 = time.monotonic()
    r = subprocess.run([*cli, "submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster", str(cluster),
                        "--detach", "trainer.max_steps=150", "trainer.logging_steps=1",
                        f"trainer.output_dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30, "submit --detach did not return promptly"
    m = re.search(r"^job (\S+) RUNNING \(supervisor pid (\d+)\)", r.stdout, re.MULTILINE)
    assert m, r.stdout
    job, supervisor = m.group(1), int(m.group(2))

    att = subprocess.Popen([*cli, "attach", job], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = att.stdout.readline()
        lines.append(line)
        if line.startswith("progress: step") or not line:
            break
    assert any(x.startswith("progress: step") for x in lines), "".join(lines)
    att.send_signal(signal.SIGINT)
    out = att.communicate(timeout=30)[0]
    assert f"detached from job {job}; it keeps running" in out and att.returncode == 0, out
    tokens = [agent_info(testbed, h, job, n)["token"] for n, h in enumerate(testbed.hosts[:2])]
    assert all(marked(t) for t in tokens), "detaching the viewer stopped the job"

    fin = subprocess.run([*cli, "attach", job], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert fin.returncode == 0, fin.stdout[-3000:] + fin.stderr[-3000:]
    assert "COMPLETED" in fin.stdout, fin.stdout[-3000:]
    st = json.loads(subprocess.run([*cli, "status", job, "--json"], cwd=REPO, env=env, capture_output=True,
                                   text=True, timeout=60).stdout)
    assert st["state"] == "COMPLETED", st
    ranks = {r["rank"]: r for r in st["ranks"]}
    assert set(ranks) == {0, 1} and all(r["step"] == 150 for r in ranks.values()), st["ranks"]
    local = Path(st["run_dir"])
    assert (local / "heartbeats" / "rank1.jsonl").exists()  # forwarded over SSH, no shared filesystem
    deadline = time.monotonic() + 10
    while (any(marked(t) for t in tokens) or _alive(supervisor)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(marked(t) for t in tokens) and not _alive(supervisor)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

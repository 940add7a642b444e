"""Own code on every backend (issue #12): a user's Hugging Face Trainer script that never imports orchestrate, as a
`run: {script: ...}` job on 2 nodes on this machine (local), over real sshd hosts (ssh) and on the SLURM testbed:
COMPLETED, per-step heartbeats from every rank written by the zero-code hooks, the same parameters on every rank
(gradients synced). The fault behaviour of own code (a plain torch loop: SIGKILL, SIGSTOP named through torch's
optimizer-step hook, sys.exit(3)) is tests/faults/test_faults.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

import jobrun
from orchestrator import api
from orchestrator.node.heartbeat import read_all
from orchestrator.node.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("user_train.py")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "ssh", "slurm"])
def test_users_trainer_script_on_two_nodes(backend, tmp_path, request, job_guard):
    from recipes.tiny import resolve_model_path
    model = resolve_model_path("tiny-llama")
    overrides: list[str] = []
    cluster_file = None
    if backend == "ssh":
        tb = request.getfixturevalue("fault_sshd")
        cluster_file = tmp_path / "ssh.yaml"
        cluster_file.write_text(yaml.safe_dump(tb.cluster("faultlab")))
    elif backend == "slurm":
        request.getfixturevalue("fault_slurm")
        from slurm_helpers import WORK
        cluster_file = REPO / "cluster_configs" / "slurm_local.yaml"
        overrides = [f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={WORK}"]
    out = tmp_path / "out"
    if backend == "slurm":
        from slurm_helpers import WORK
        out = Path(WORK) / f"out-{tmp_path.name}"
    job = tmp_path / "my_job.yaml"
    job.write_text(yaml.safe_dump({
        "run": {"script": str(SCRIPT), "args": [model, str(REPO / "recipes/data/sft_tiny.jsonl"), str(out), "8"]},
        "health": {"stall_timeout": 120, "startup_timeout": 300}}))
    prep = api.prepare(str(job), str(cluster_file) if cluster_file else None, nodes=2, cwd=tmp_path,
                       overrides=overrides)
    rd = RunDir(prep.plan.run_dir)
    api.write_files(prep.files, rd.root)
    job_guard.run_dir(rd.root)
    from orchestrator.launchers import launcher_for
    lines: list = []
    res = jobrun.run(launcher_for(prep.cluster), prep.plan, rd.root, lines=lines, timeout=600)
    text = "\n".join(f"[node{r}] {line}" for r, line in lines)
    assert res.state == "COMPLETED", res.root_cause + "\n" + text[-3000:]
    params = [json.loads(line.split(" ", 1)[1]) for _, line in lines if line.startswith("USER_PARAMS ")]
    assert sorted(p["rank"] for p in params) == [0, 1] and {p["world"] for p in params} == {2}, text[-3000:]
    assert len({p["sha"] for p in params}) == 1, params  # the same parameters on every rank: gradients synced
    beats = read_all(rd.heartbeats)
    for rank in (0, 1):
        steps = sorted({b["step"] for b in beats if b.get("rank") == rank and b.get("event") == "step"})
        assert steps and steps[-1] == 8, (rank, steps)  # written by the hooks: the script writes none
        assert any(b.get("loss") is not None for b in beats if b.get("rank") == rank and b.get("event") == "step")

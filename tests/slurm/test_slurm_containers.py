"""Containers on the real SLURM testbed (issue #25): `runtime: podman` inside the allocation, through the same
code path that builds every node's command (the node agent stays outside and starts the launcher in the image),
trains to COMPLETED; `scontrol requeue` makes the ranks in the container save, and the requeued run resumes past the
checkpoint in a fresh container; nothing is left in the node namespaces or in podman."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jobrun
from launchers.slurm.launcher import SlurmLauncher
from orchestrator.node.ranklines import split_rank
from orchestrator.node.rundir import RunDir
from podman_testbed import OFFLINE, containers_of, test_image
from slurm_helpers import WORK, node_namespace_leftovers, wait_clean, wait_until

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.containers]


def _heartbeat_step(run_dir: Path) -> int:
    return RunDir(run_dir).furthest_step() or 0


def test_podman_in_the_allocation_completes_and_a_requeue_resumes_past_the_checkpoint(slurm_cluster):
    from orchestrator import api
    image = test_image()
    work = Path(os.environ.get("ORCHESTRATE_SLURM_WORK", WORK))
    out = work / f"out-podman-{time.time_ns()}"
    prep = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(REPO / "cluster_configs" / "slurm_local.yaml"),
                       nodes=2, cwd=REPO, overrides=[
                           f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={work}",
                           f"trainer.output_dir={out}", "trainer.max_steps=300",
                           f"cluster.container.image={image}", "cluster.container.runtime=podman",
                           f"cluster.container.mounts=[{work}:{work}]",
                           *(f"cluster.env.{k}={v}" for k, v in OFFLINE.items())])
    assert prep.plan.container is not None and prep.plan.container.runtime == "podman"
    run_dir = Path(prep.plan.run_dir)
    api.write_files(prep.files, run_dir)
    L = SlurmLauncher(prep.cluster)
    h = L.submit(L.prepare(prep.plan), RunDir(prep.plan.run_dir))
    job = prep.plan.job_id
    wait_until(lambda: _heartbeat_step(run_dir) >= 20, 240, "training to reach step 20 in the containers")
    assert len(containers_of(job)) == 2, containers_of(job)
    subprocess.run(["scontrol", "requeue", h.handle.data["job_id"]], check=True)
    res = jobrun.watch(h, prep.plan, timeout=500)
    assert res.state == "COMPLETED", res
    text = (run_dir / "logs" / "node0.log").read_text()
    result = [t for t in (split_rank(ln)[1] for ln in text.splitlines()) if t.startswith("ORCHESTRATE_RESULT ")][-1]
    m = re.search(r'"resumed_from": "[^"]*checkpoint-(\d+)"', result)
    assert m and int(m.group(1)) >= 20, _what_happened(run_dir, out, text)
    assert '"global_step": 300' in result and '"world_size": 2' in result
    assert any("requeued by SLURM" in a.reason for a in RunDir(run_dir).attempts())
    for r in range(2):  # each node agent checked its node for the container and recorded the image
        rec = (run_dir / "nodes" / str(r) / "container.json").read_text()
        assert image in rec and '"torch"' in rec, rec
    wait_until(lambda: not containers_of(job), 30, "the job's containers gone")
    assert wait_clean(15) == {}, node_namespace_leftovers()


def _what_happened(run_dir: Path, out: Path, log: str) -> str:
    """For a failed resume: what each attempt said about itself, the attempts' records and the checkpoints."""
    said = [ln for ln in log.splitlines() if re.search(r"orchestrate|resum|signal|Received|ORCHESTRATE_RESULT", ln)]
    attempts = (run_dir / "restarts.jsonl").read_text() if (run_dir / "restarts.jsonl").exists() else "(none)"
    return "\n".join([*(ln[:300] for ln in said), f"restarts.jsonl: {attempts}",
                      f"output dir: {sorted(p.name for p in out.iterdir()) if out.is_dir() else 'missing'}"])

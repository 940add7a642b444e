"""Helpers for the SLURM backend tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from helpers import wait_until  # the tests import it from here too; the old order (pred, timeout, what) works

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
CLUSTER_DIR = os.environ.get("ORCHESTRATE_SLURM_DIR", "/tmp/orchestrate-slurm")
WORK = Path(os.environ.get("ORCHESTRATE_SLURM_WORK", "/tmp/orchestrate-slurm-work"))
PAYLOAD = Path(__file__).resolve().parent / "payload.py"
NS_PREFIX = "osl-"  # the testbed's node namespaces: osl-node1, osl-node2, ... (scripts/slurm_cluster.sh, default --dir)
NODES = 2  # what the tests' jobs use
CLUSTER_NODES = NODES + 1  # what the testbed has: one more, the spare a bad-node test moves to
SCALE_NODES = 16  # issue #29's scale test (test_slurm_scale.py) has the testbed at this size for its own run (resized)
NEEDED = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch", "srun", "sacct", "nsenter", "ip")


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (network namespaces, daemons)"
    missing = [b for b in NEEDED if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"SLURM packages missing ({', '.join(missing)}): run scripts/install_slurm_deps.sh"
    return None


def node_namespace_leftovers() -> dict[str, list[str]]:
    """Processes in the node namespaces (osl-nodeK) other than slurmd itself (zombies count as gone)."""
    from scale_job import netns_processes
    return netns_processes(NS_PREFIX)


def wait_clean(timeout: float = 15.0) -> dict[str, list[str]]:
    """What is still left in the node namespaces after up to `timeout` s ({} once clean)."""
    try:
        wait_until(lambda: not node_namespace_leftovers(), timeout, 0.2, "the node namespaces to be clean")
    except AssertionError:
        pass
    return node_namespace_leftovers()


def local_cluster(**slurm_overrides):
    """The testbed ClusterSpec (cluster_configs/slurm_local.yaml) with this interpreter as python."""
    from orchestrator.core.spec import parse_cluster, read_yaml
    c = parse_cluster(read_yaml(str(REPO / "cluster_configs" / "slurm_local.yaml"), "cluster"),
                      str(REPO / "cluster_configs" / "slurm_local.yaml"))
    return replace(c, slurm=replace(c.slurm, python=sys.executable, workdir=str(WORK), **slurm_overrides))


def trivial_plan(name: str, payload_args: list[str], nodes: int = NODES, cluster=None):
    """A LaunchPlan whose nodes run tests/slurm/payload.py (no torch): launcher mechanics only."""
    from orchestrator.core.health import HealthSpec
    from orchestrator.core.jobplan import LATE_MAIN_IP, LaunchPlan, NodePlan
    job_id = f"{name}-{int(time.time() * 1000) % 10**9}"
    run_dir = str(WORK / "runs" / job_id)
    cmd = (sys.executable, str(PAYLOAD), *payload_args)
    nps = tuple(NodePlan(node_rank=r, host="", ranks=(r,), accelerate_config={"main_process_ip": LATE_MAIN_IP},
                         command=cmd, env={}) for r in range(nodes))
    plan = LaunchPlan(job_id=job_id, recipe="sft", recipe_name=name, cluster_kind="slurm",
                      cluster_name="slurm_local", accelerator="cpu", profile="multi_gpu",
                      distributed_type="MULTI_GPU", nodes=nodes, procs_per_node=1, world_size=nodes,
                      parallelism={"dp_replicate": 1, "dp_shard": nodes, "tp": 1, "cp": 1, "sp": 1},
                      data_parallel_size=nodes, per_device_batch=1, grad_accum=1, effective_batch=nodes,
                      max_length=None, tokens_per_step=None, tokens_per_step_exact=False, main_host=LATE_MAIN_IP,
                      port=29500, run_dir=run_dir, output_dir=run_dir + "/out", python=sys.executable,
                      secret_env=(), node_plans=nps, health=HealthSpec(max_restarts=3))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "plan.json").write_text(plan.to_json())
    return plan


def heartbeat_step(run_dir: str | Path) -> int:
    from orchestrator.node.rundir import RunDir
    return RunDir(run_dir).furthest_step() or 0


def cluster_nodes(env: dict) -> int:
    """How many nodes the running testbed has (sinfo)."""
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=dict(env, SLURM_CONF=f"{CLUSTER_DIR}/etc/slurm.conf"),
                       capture_output=True, text=True, timeout=30)
    return len(set(r.stdout.split()))


def resized(nodes: int):
    """The running testbed brought down and up again with `nodes` nodes (generator, for a fixture; the suite runs one
    test at a time): yields, then puts it back at CLUSTER_NODES, the size the other tests expect (their GPU map, the
    spare). Costs ~15-20 s in all (down and up twice)."""
    import pytest
    env = dict(os.environ, ORCHESTRATE_SLURM_DIR=CLUSTER_DIR)

    def size(n: int) -> None:
        if cluster_nodes(env) == n:
            return
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)
        r = subprocess.run([str(SCRIPT), "up", "--nodes", str(n)], env=env, capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            pytest.fail(f"slurm_cluster.sh up --nodes {n} failed:\n{r.stdout}\n{r.stderr}")
    size(nodes)
    try:
        yield nodes
    finally:
        size(CLUSTER_NODES)


def cluster_session():
    """The testbed cluster for a pytest session fixture (generator): reused when up, brought up (and torn down at the
    end) otherwise; skips with the reason when unavailable, fails instead under CI=true."""
    import pytest
    why = unavailable()
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # (as the other testbeds read it)
            pytest.fail(f"CI={os.environ['CI']} but {why}")
        pytest.skip(why)
    env = dict(os.environ, ORCHESTRATE_SLURM_DIR=CLUSTER_DIR)
    was_up = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True).returncode == 0
    if was_up and cluster_nodes(env) != CLUSTER_NODES:  # up with another size (an older run): make it this one
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)
        was_up = False
    if not was_up:
        r = subprocess.run([str(SCRIPT), "up", "--nodes", str(CLUSTER_NODES)], env=env, capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            pytest.fail(f"slurm_cluster.sh up failed:\n{r.stdout}\n{r.stderr}")
    os.environ["SLURM_CONF"] = f"{CLUSTER_DIR}/etc/slurm.conf"
    WORK.mkdir(parents=True, exist_ok=True)
    yield {"dir": CLUSTER_DIR, "nodes": NODES, "partition": "debug"}
    if not was_up and os.environ.get("ORCHESTRATE_SLURM_KEEP") != "1":
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)

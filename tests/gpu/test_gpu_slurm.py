"""GPUs and the network pre-flight on the real SLURM testbed with fake GPU GRES (node1 gpu:8, node2 gpu:2): a GPU
request only some nodes can meet is refused with the nodes and their GPUs named; the allocation's CUDA_VISIBLE_DEVICES
is what a `gpus:` subset maps through; a bogus interface (checked by each node agent), an interface that exists but does
not reach the other node (the ranks' pre-flight) and a rendezvous port dropped by a firewall in a node's namespace each
end the job with a named failure within seconds, nothing left running in the node namespaces."""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _prepare(tag: str, *overrides: str, nodes: int = 2):
    from orchestrator import api
    from slurm_helpers import WORK
    work = os.environ.get("ORCHESTRATE_SLURM_WORK", str(WORK))
    return api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(REPO / "cluster_configs" / "slurm_local.yaml"),
                       nodes=nodes, cwd=REPO,
                       overrides=[f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={work}",
                                  f"trainer.output_dir={work}/out-{tag}-{time.time_ns()}", "trainer.max_steps=3",
                                  f"launch.port={random.randint(20000, 29000)}", "launch.procs_per_node=auto",
                                  "health.max_restarts=0",  # one attempt: its own time is what is measured
                                  *overrides])


def _submit(prep):
    from orchestrator import running
    t0 = time.monotonic()
    res = running.submit(prep)
    return res, time.monotonic() - t0


def test_gpus_only_some_nodes_have_are_refused_with_the_nodes_named(slurm_gres_cluster):
    from orchestrator import running
    from orchestrator.errors import ConfigError
    prep = _prepare("gres8", "cluster.accelerator=gpu", "cluster.slurm.gpus_per_node=8",
                    "cluster.slurm.max_gpus_per_node=8")
    assert prep.plan.procs_per_node == 8  # auto: one per allocated GPU
    with pytest.raises(ConfigError) as e:
        running.submit(prep)
    msg = {p.where: p.message for p in e.value.problems}["slurm.gpus_per_node"]
    assert "SLURM rejects the job" in msg
    assert "GPUs per node: node1 8, node2 2, node3 2: 1 node(s) have 8 or more: node1" in msg, msg


def _gpu_payload_plan(tag: str, gpus_per_node: int, subset: str):
    """A 2-node plan whose nodes print what their rank would see (no torch): accelerator gpu, `subset` bound."""
    from launchers.slurm.launcher import SlurmLauncher
    from slurm_helpers import local_cluster, trivial_plan
    script = HERE / "gpu_payload.py"
    plan = trivial_plan(tag, [])
    nodes = tuple(dataclasses.replace(n, command=(sys.executable, str(script)), env={"CUDA_VISIBLE_DEVICES": subset})
                  for n in plan.node_plans)
    plan = dataclasses.replace(plan, accelerator="gpu", node_plans=nodes, gpus_per_node=gpus_per_node)
    Path(plan.run_dir, "plan.json").write_text(plan.to_json())
    return plan, SlurmLauncher(local_cluster(gpus_per_node=gpus_per_node))


def _run_payload(plan, launcher):
    from orchestrator.node.rundir import RunDir
    from orchestrator.supervise import Supervisor
    job = launcher.submit(launcher.prepare(plan), RunDir(plan.run_dir))
    return Supervisor(plan).run(job)


def test_a_gpu_subset_maps_through_the_allocation(slurm_gres_cluster):
    from slurm_helpers import wait_clean
    plan, launcher = _gpu_payload_plan("gpusub", 2, "1")
    res = _run_payload(plan, launcher)
    assert res.state == "COMPLETED", res
    for r in (0, 1):
        log = Path(plan.run_dir, "logs", f"node{r}.log").read_text()
        assert "gpu_payload: CUDA_VISIBLE_DEVICES=1 SLURM_GPUS_ON_NODE=2" in log, log
    # the plan binds GPU 1 but the allocation has one GPU (SLURM's CUDA_VISIBLE_DEVICES=0): refused on the node
    plan, launcher = _gpu_payload_plan("gpubad", 1, "1")
    res = _run_payload(plan, launcher)
    assert res.state == "FAILED" and "PreflightError: node " in res.root_cause, res
    assert "the plan binds GPU(s) 1 but this node may use only 1 (CUDA_VISIBLE_DEVICES=0)" in res.root_cause
    assert wait_clean() == {}


def test_a_bogus_interface_is_named_by_the_node_agents(slurm_gres_cluster):
    from slurm_helpers import wait_clean
    prep = _prepare("bogus", "cluster.network_interface=bogus0")
    res, took = _submit(prep)
    assert res.state == "FAILED", res
    assert "PreflightError: network_interface 'bogus0' does not exist on node" in res.root_cause, res.root_cause
    assert "(its interfaces: " in res.root_cause and "eth0" in res.root_cause
    assert took < 10, f"{took:.1f} s"
    assert wait_clean() == {}
    print(f"bogus interface on SLURM: FAILED after {took:.2f} s: {res.root_cause}")


@pytest.mark.slow
def test_an_interface_that_does_not_reach_the_peer_fails_the_rank_preflight(slurm_gres_cluster):
    """lo exists on every node, but a peer's loopback is not this node's: gloo would hang or fail deep in its full
    mesh; the ranks' pre-flight names who cannot reach whom over which interface."""
    from slurm_helpers import wait_clean
    prep = _prepare("lo", "cluster.network_interface=lo", "health.preflight_timeout=8")
    res, took = _submit(prep)
    assert res.state == "FAILED", res
    assert "PreflightError: network pre-flight failed (interface lo, backend gloo): node " in res.root_cause, \
        res.root_cause
    assert "cannot reach node " in res.root_cause and "127.0.0.1" in res.root_cause
    assert took < 10, f"{took:.1f} s"
    assert wait_clean() == {}
    log = "".join(Path(prep.plan.run_dir, "logs", f"node{r}.log").read_text() for r in (0, 1))
    assert "Traceback" not in log.split("PreflightError")[0][-2000:]  # named before any training code ran
    print(f"wrong interface on SLURM: FAILED after {took:.2f} s: {res.root_cause}")


@pytest.mark.slow
def test_a_dropped_rendezvous_port_is_named_in_seconds(slurm_gres_cluster, nft_drop):
    from slurm_helpers import wait_clean
    prep = _prepare("drop", "health.preflight_timeout=4")
    nft_drop(prep.plan.port, netns="osl-node1", iif="eth0")  # node1's firewall drops its rendezvous port
    res, took = _submit(prep)
    assert res.state == "FAILED", res
    assert "PreflightError: network pre-flight failed: node 1 (node2) cannot reach node1:" in res.root_cause, \
        res.root_cause
    assert "within 4 s (connection attempts time out" in res.root_cause and "interface eth0" in res.root_cause
    assert took < 10, f"{took:.1f} s"
    assert wait_clean() == {}
    print(f"dropped rendezvous port on SLURM: FAILED after {took:.2f} s: {res.root_cause}")


def test_a_node_whose_gpu_fails_its_health_check_is_excluded_from_the_next_allocation(slurm_gres_cluster, tmp_path,
                                                                                      monkeypatch):
    """node2's GPU 1 reports uncorrectable ECC errors (the stand-in nvidia-smi, answering by hostname): its node agent
    refuses the node ('GPU health: ...'), the restart policy takes node2 out, the next allocation is submitted with
    --exclude=node2, runs on node1 and node3 (the spare) and completes; restarts.jsonl and status say why."""
    import json
    from orchestrator import api
    from orchestrator import running
    from slurm_helpers import WORK, wait_clean
    table = tmp_path / "health.json"
    table.write_text(json.dumps({"node2": {"1": {"ecc.errors.uncorrected.volatile.total": 3}}}))
    for k, v in {"ORCHESTRATE_NVIDIA_SMI": str(REPO / "tests" / "fakes" / "nvidia-smi"), "FAKE_NVIDIA_GPUS": "2",
                 "FAKE_NVIDIA_HEALTH_MAP": str(table)}.items():
        monkeypatch.setenv(k, v)  # (the job's tasks get the submitting environment)
    job = tmp_path / "payload.yaml"
    job.write_text(json.dumps({"run": {"script": str(HERE / "gpu_payload.py")}, "launch": {"nodes": 2},
                               "health": {"preflight_timeout": 0, "max_restarts": 2}}))
    work = os.environ.get("ORCHESTRATE_SLURM_WORK", str(WORK))
    prep = api.prepare(str(job), str(REPO / "cluster_configs" / "slurm_local.yaml"), cwd=tmp_path, overrides=[
        f"cluster.slurm.python={sys.executable}", f"cluster.slurm.workdir={work}", "cluster.accelerator=gpu",
        "cluster.slurm.gpus_per_node=2", f"launch.port={random.randint(20000, 29000)}"])
    res = running.submit(prep)
    assert res.state == "COMPLETED", res
    run_dir = Path(prep.plan.run_dir)
    attempts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(a["decision"], a["host"], a["kind"], a["exclude"]) for a in attempts] == [
        ("restart", "node2", "health", "node2")], attempts
    assert "GPU 1: ecc.errors.uncorrected.volatile.total = 3" in attempts[0]["reason"], attempts
    assert "#SBATCH --exclude=node2" in (run_dir / "job.sbatch").read_text()
    hosts = sorted(json.loads((run_dir / "nodes" / str(r) / "agent.json").read_text())["host"] for r in range(2))
    assert hosts == ["node1", "node3"], hosts
    assert wait_clean() == {}

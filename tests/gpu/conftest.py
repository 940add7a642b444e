"""Fixtures of the GPU-planning and network pre-flight suite (tests/gpu). None of it needs a GPU: a fake
`nvidia-smi` (tests/fakes/nvidia-smi) stands in on the SSH hosts and for this machine, the SLURM testbed has fake GPU
GRES (scripts/slurm_cluster.sh --gpus 8,2: node1 gpu:8, node2 gpu:2), and nftables tables of our own cut ports.

The suite-wide conftest skips every test whose keywords include "gpu" on a machine without nvidia-smi; this directory
is named gpu, so that rule would skip all of it: tests here are GPU-free unless they carry the `gpu` marker
themselves, and the skip is taken off the others.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKES = REPO / "tests" / "fakes"
FAKE_SMI = FAKES / "nvidia-smi"
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "slurm"))
from slurm_helpers import CLUSTER_NODES  # noqa: E402

SSH_BASE_IP = os.environ.get("ORCHESTRATE_TEST_GPU_SSH_BASE_IP", "127.0.12.2")
SSH_PORT = int(os.environ.get("ORCHESTRATE_TEST_GPU_SSH_PORT", "2222"))
SLURM_GPUS = "8,2"  # node1 gpu:8, node2 gpu:2 (the other nodes of the testbed, spares, gpu:2 too)
GRES = {f"node{k}": 8 if k == 1 else 2 for k in range(1, CLUSTER_NODES + 1)}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE) and item.get_closest_marker("gpu") is None:
            item.own_markers[:] = [m for m in item.own_markers
                                   if not (m.name == "skip" and "CUDA GPUs" in str(m.kwargs.get("reason", "")))]


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"testbed prerequisite missing under CI: {reason}", pytrace=False)
    pytest.skip(reason)


# ------------------------------------------------------------------------------------------------ fake GPUs

@pytest.fixture
def fake_local_gpus(monkeypatch):
    """fake_local_gpus(n): this machine shows n fake GPUs to orchestrate (ORCHESTRATE_NVIDIA_SMI)."""
    def make(n: int) -> None:
        monkeypatch.setenv("ORCHESTRATE_NVIDIA_SMI", str(FAKE_SMI))
        monkeypatch.setenv("FAKE_NVIDIA_GPUS", str(n))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return make


# ------------------------------------------------------------------------------------------------ SSH hosts

@pytest.fixture(scope="session")
def gpu_testbed(tmp_path_factory):
    """Three sshd hosts on loopback (scripts/sshd_hosts.py) of this suite's own (127.0.12.x): 2 for a job, 1 spare."""
    import sshd_hosts
    why = sshd_hosts.prerequisites()
    if why:
        _unavailable(f"SSH testbed unavailable: {why}")
    d = tmp_path_factory.mktemp("gpu_sshd")
    try:
        tb = sshd_hosts.up(3, d, base_ip=SSH_BASE_IP, port=SSH_PORT)
    except RuntimeError as e:
        _unavailable(f"SSH testbed unavailable: {e}")
    yield tb
    sshd_hosts.down(d)


@pytest.fixture
def gpu_hosts(gpu_testbed, tmp_path):
    """gpu_hosts({host: n GPUs}, network_interface="lo", accelerator="gpu", **ssh_overrides) -> (ClusterSpec, its YAML
    file): kind ssh, whose remote python sees the fake nvidia-smi (on PATH) answering n GPUs on each host."""
    import yaml
    from orchestrator.core.spec import parse_cluster

    def make(gpus: dict[str, int], network_interface: str | None = "lo", accelerator: str = "gpu",
             health: dict | None = None, health_file: Path | None = None, **over):
        table = tmp_path / f"gpus-{uuid.uuid4().hex[:6]}.json"
        table.write_text(json.dumps(gpus))
        # {host: {"GPU index": {field: value}}}; `health_file`: the caller's, to change while a job runs
        health_table = health_file or tmp_path / f"health-{uuid.uuid4().hex[:6]}.json"
        health_table.write_text(json.dumps(health or {}))
        wrapper = tmp_path / f"python-{uuid.uuid4().hex[:6]}"
        wrapper.write_text(f"#!/bin/sh\nPATH={FAKES}:$PATH FAKE_NVIDIA_GPUS_MAP={table} "
                           f"FAKE_NVIDIA_HEALTH_MAP={health_table} exec {gpu_testbed.python} " '"$@"\n')
        wrapper.chmod(0o755)
        block = gpu_testbed.ssh_block(hosts=list(gpus), python=str(wrapper), **over)
        data = {"kind": "ssh", "name": "gpulab", "accelerator": accelerator, "ssh": block}
        if network_interface is not None:
            data["network_interface"] = network_interface
        path = tmp_path / f"cluster-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(data))
        return parse_cluster(data, source=str(path)), path
    return make


# ------------------------------------------------------------------------------------------------ SLURM

@pytest.fixture(scope="session")
def slurm_gres_cluster():
    """The SLURM testbed (scripts/slurm_cluster.sh) up with fake GPU GRES node1 gpu:8, node2 gpu:2. A cluster that is
    up with other GRES is brought down and up again with these (run under the testbed lock: nobody else uses it
    meanwhile); one that was up is left up, one brought up here is taken down at the end."""
    from slurm_helpers import CLUSTER_DIR, CLUSTER_NODES, SCRIPT, unavailable
    why = unavailable()
    if why:
        _unavailable(why)
    env = dict(os.environ, ORCHESTRATE_SLURM_DIR=CLUSTER_DIR, SLURM_CONF=f"{CLUSTER_DIR}/etc/slurm.conf")
    was_up = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True).returncode == 0
    if was_up and _gres(env) != GRES:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)
        up = False
    else:
        up = was_up
    if not up:
        r = subprocess.run([str(SCRIPT), "up", "--nodes", str(CLUSTER_NODES), "--gpus", SLURM_GPUS], env=env,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.fail(f"slurm_cluster.sh up failed:\n{r.stdout}\n{r.stderr}")
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    assert _gres(env) == GRES
    yield {"dir": CLUSTER_DIR, "nodes": CLUSTER_NODES}
    if not was_up and os.environ.get("ORCHESTRATE_SLURM_KEEP") != "1":
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)


def _gres(env) -> dict[str, int]:
    from launchers.slurm.launcher import parse_gres_gpus
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], env=env, capture_output=True, text=True)
    return {w[0]: parse_gres_gpus(w[1]) for w in (ln.split() for ln in r.stdout.splitlines()) if len(w) >= 2}


# ------------------------------------------------------------------------------------------------ nftables

@pytest.fixture
def nft_drop():
    """nft_drop(port, daddr=None, netns=None, iif=None): drop TCP packets to `port` (and `daddr`) in a table of
    this test's own (in network namespace `netns` when given); the table is always deleted at the end."""
    if shutil.which("nft") is None or os.geteuid() != 0:
        _unavailable("nftables (nft) and root are needed to cut a port")
    made: list[tuple[str | None, str]] = []

    def nft(netns: str | None, *args: str) -> subprocess.CompletedProcess:
        argv = (["ip", "netns", "exec", netns] if netns else []) + ["nft", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    def drop(port: int, daddr: str | None = None, netns: str | None = None, iif: str | None = None) -> str:
        table = f"orch_gpu_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        made.append((netns, table))
        match = (f"iifname {iif} " if iif else "") + (f"ip daddr {daddr} " if daddr else "") + f"tcp dport {port}"
        for args in (("add", "table", "inet", table),
                     ("add", "chain", "inet", table, "input", "{ type filter hook input priority -10 ; }"),
                     ("add", "rule", "inet", table, "input", *match.split(), "drop")):
            r = nft(netns, *args)
            assert r.returncode == 0, f"nft {' '.join(args)}: {r.stderr}"
        return table

    yield drop
    for netns, table in made:
        nft(netns, "delete", "table", "inet", table)

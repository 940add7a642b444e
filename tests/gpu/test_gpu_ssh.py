"""GPUs and the network pre-flight on real SSH hosts (the loopback sshd testbed, 127.0.12.x) with a fake nvidia-smi on
each host's PATH: procs_per_node auto asks the hosts, uneven hosts and idle GPUs are refused by the pre-flight with the
hosts named before anything starts, a bogus interface is named by the probe, and a rendezvous port dropped by a
firewall (nftables) is a named failure within seconds instead of torchrun's 10-minute static rendezvous."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from helpers import job_pids, wait_until

pytestmark = [pytest.mark.ssh]
REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "configs" / "sft_tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _remote_run_dirs(testbed, plan) -> list[Path]:
    return [Path(testbed.dir) / "work" / n.host / "runs" / plan.job_id for n in plan.node_plans]


def _processes_of(job_id: str) -> list[str]:
    """Live processes whose command line names the job (its run dirs): what a test must not leave behind."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if job_id in cmd and state not in ("Z", "X"):
            out.append(f"{pid}: {cmd[:160]}")
    return out


def test_auto_asks_every_host_for_its_gpus(gpu_testbed, gpu_hosts, home):
    from orchestrator import api
    from orchestrator.errors import ConfigError
    a, b = gpu_testbed.hosts[:2]
    _, path = gpu_hosts({a: 8, b: 8})
    prep = api.prepare(RECIPE, str(path), nodes=2, overrides=["launch.procs_per_node=auto"], cwd=REPO)
    assert (prep.plan.procs_per_node, prep.plan.world_size, prep.plan.gpus_per_node) == (8, 16, 8)
    _, path = gpu_hosts({a: 8, b: 2})
    with pytest.raises(ConfigError) as e:
        api.prepare(RECIPE, str(path), nodes=2, overrides=["launch.procs_per_node=auto"], cwd=REPO)
    assert f"the hosts have different GPU counts ({a} 8, {b} 2)" in str(e.value)


@pytest.mark.parametrize("gpus,procs,where,text", [
    ((8, 2), 2, "ssh.hosts", "the hosts have different GPU counts ({a} 8 x NVIDIA H100 80GB HBM3, {b} 2 x NVIDIA H100"),
    ((8, 8), 1, "launch.procs_per_node", "7 of the 8 GPUs of each host would be idle"),
    ((2, 2), 4, "launch.procs_per_node", "4 processes per node, but each host gives the job 2 GPU(s)"),
])
def test_preflight_refuses_what_the_hosts_gpus_cannot_run(gpu_testbed, gpu_hosts, home, job_guard, gpus, procs, where,
                                                          text):
    from orchestrator import api
    from orchestrator.errors import PreflightError
    from orchestrator.node.rundir import RunDir
    a, b = gpu_testbed.hosts[:2]
    cluster, path = gpu_hosts({a: gpus[0], b: gpus[1]})
    prep = api.prepare(RECIPE, str(path), nodes=2, overrides=[f"launch.procs_per_node={procs}"], cwd=REPO)
    assert prep.plan.gpus_per_node is None  # an explicit count: the hosts are asked by the pre-flight only
    local = home / "runs" / prep.plan.job_id
    api.write_files(prep.files, local)
    job_guard.run_dir(local, *_remote_run_dirs(gpu_testbed, prep.plan))
    from launchers.ssh.launcher import SSHLauncher
    launcher = SSHLauncher(cluster)
    with pytest.raises(PreflightError) as e:
        launcher.submit(launcher.prepare(prep.plan), RunDir(local))
    msgs = {p.where: p.message for p in e.value.problems}
    assert text.format(a=a, b=b) in msgs[where], msgs
    assert all(RunDir(d).agent(r) is None for r, d in enumerate(_remote_run_dirs(gpu_testbed, prep.plan)))
    wait_until(lambda: not _processes_of(prep.plan.job_id), 10, 0.1, "the probing agents to stand down")


def test_bogus_interface_is_named_by_the_probe_in_seconds(gpu_testbed, gpu_hosts, home, job_guard):
    from orchestrator import api
    from orchestrator import running
    from orchestrator.errors import PreflightError
    a, b = gpu_testbed.hosts[:2]
    _, path = gpu_hosts({a: 0, b: 0}, network_interface="bogus0", accelerator="cpu")
    prep = api.prepare(RECIPE, str(path), nodes=2, cwd=REPO)
    job_guard.run_dir(home / "runs" / prep.plan.job_id, *_remote_run_dirs(gpu_testbed, prep.plan))
    t0 = time.monotonic()
    with pytest.raises(PreflightError) as e:
        running.submit(prep)
    took = time.monotonic() - t0
    msgs = {p.where: p.message for p in e.value.problems}
    for host in (a, b):
        assert "network_interface 'bogus0' does not exist on" in msgs[host], msgs
    assert took < 10, took
    wait_until(lambda: not _processes_of(prep.plan.job_id), 10, 0.1, "the probing agents to stand down")
    print(f"bogus interface named by the SSH pre-flight after {took:.2f} s")


@pytest.mark.slow
def test_dropped_rendezvous_port_is_a_named_failure_in_seconds(gpu_testbed, gpu_hosts, home, job_guard, nft_drop):
    from orchestrator import api
    from orchestrator import running
    a, b = gpu_testbed.hosts[:2]
    _, path = gpu_hosts({a: 0, b: 0}, accelerator="cpu")
    port = free_port()
    prep = api.prepare(RECIPE, str(path), nodes=2, cwd=REPO,
                       overrides=[f"launch.port={port}", "health.preflight_timeout=4", "trainer.max_steps=3",
                                  f"trainer.output_dir={home / 'out'}"])
    local = home / "runs" / prep.plan.job_id
    job_guard.run_dir(local, *_remote_run_dirs(gpu_testbed, prep.plan))
    nft_drop(port, daddr=a)  # a firewall on the main host drops its rendezvous port
    t0 = time.monotonic()
    res = running.submit(prep)
    took = time.monotonic() - t0
    assert res.state == "FAILED", res
    assert res.root_cause.startswith(f"node 1 ({b}) failed: exit code 69 | PreflightError: network pre-flight failed: "
                                     f"node 1"), res.root_cause
    assert f"cannot reach {a}:{port} within 4 s (connection attempts time out: packets to the port are dropped" \
           in res.root_cause and "interface lo" in res.root_cause
    assert took < 15, f"{took:.1f} s"
    assert job_pids(local, *_remote_run_dirs(gpu_testbed, prep.plan)) == []
    wait_until(lambda: not _processes_of(prep.plan.job_id), 10, 0.1, "nothing of the job left running")
    print(f"dropped rendezvous port named after {took:.2f} s (submit to FAILED): {res.root_cause}")


def test_two_jobs_on_different_gpus_of_the_same_hosts_run_at_once_each_on_its_own_port(gpu_testbed, gpu_hosts, home,
                                                                                           tmp_path, job_guard):
    """Two 2-node jobs, one on GPU 0 and one on GPU 1 of the same two hosts (the fake nvidia-smi shows 2 each), started
    together: their leases (host shared, GPU exclusive) let both run at once, and neither gives launch.port, so each
    rendezvous on a port of its own on the shared main host (core.jobplan.job_port; both on 29500, the second one's
    pre-flight refused the busy port). Both COMPLETED, their agents' time on the main host overlapped."""
    import json
    import subprocess
    import sys

    import yaml

    from helpers import OFFLINE_ENV
    a, b = gpu_testbed.hosts[:2]
    _, cluster = gpu_hosts({a: 2, b: 2})
    leases = tmp_path / "leases"  # (loopback hosts share one machine: their own lease dir, as each host has its own)
    procs, jobs = [], []
    for gpu in (0, 1):
        job = tmp_path / f"gpu{gpu}.yaml"
        job.write_text(yaml.safe_dump({
            "run": {"script": str(REPO / "tests" / "faults" / "beat_loop.py"), "args": ["60", "0.05"]},
            "launch": {"nodes": 2, "procs_per_node": 1, "gpus": [gpu], "allow_idle_gpus": True},
            "health": {"preflight_timeout": 0}}))
        procs.append(job_guard.spawn([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--cluster",
                                      str(cluster), "--no-wait"], cwd=REPO,
                                     env={**os.environ, **OFFLINE_ENV, "ORCHESTRATE_LEASE_DIR": str(leases)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "COMPLETED" in out, out[-3000:]
    for run in sorted((home / "runs").iterdir()):
        jobs.append(json.loads((run / "plan.json").read_text()))
    ports = [j["port"] for j in jobs]
    assert len(set(ports)) == 2 and all(30501 <= p < 32001 for p in ports), ports
    spans = []
    for j in jobs:
        node0 = Path(gpu_testbed.dir) / "work" / a / "runs" / j["job_id"] / "nodes" / "0"
        spans.append((json.loads((node0 / "agent.json").read_text())["started"],
                      json.loads((node0 / "exit.json").read_text())["time"]))
    (s0, e0), (s1, e1) = spans
    assert max(s0, s1) < min(e0, e1), f"the two jobs did not run at once on {a}: {spans}"

"""What a node checks about itself (orchestrator.node: gpus, netcheck, probe, the agent's node_checks) and the SSH
pre-flight's comparison of the hosts' GPUs. No testbed: this machine's own interfaces and a fake sysfs/nvidia-smi."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.core.jobplan import LATE_IFNAME, RUN_DIR_VAR
from orchestrator.node import gpus, netcheck

REPO = Path(__file__).resolve().parents[2]


def test_nvidia_smi_query_parsing_and_binding():
    text = "0, NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15\n1, NVIDIA A100-SXM4-40GB, 40960, 535.1\nNo devices\n"
    assert gpus.parse_query(text) == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "550.54.15"},
        {"index": 1, "name": "NVIDIA A100-SXM4-40GB", "memory_mib": 40960, "driver": "535.1"}]
    assert gpus.bind_visible("0,1", None) == ("0,1", None)
    assert gpus.bind_visible("1,3", ["4", "5", "6", "7"]) == ("5,7", None)  # SLURM gave 4-7: indices map through
    value, why = gpus.bind_visible("2", ["4", "5"])
    assert value == "" and "binds GPU(s) 2 but this node may use only 2 (CUDA_VISIBLE_DEVICES=4,5)" in why
    assert gpus.count_visible({"CUDA_VISIBLE_DEVICES": "3,4,5"}) == 3
    assert gpus.count_visible({"SLURM_GPUS_ON_NODE": "2"}) == 2


def test_interfaces_routes_and_infiniband(tmp_path):
    assert netcheck.route_interface("127.0.0.1") == ("lo", "127.0.0.1")
    assert netcheck.route_interface("127.0.12.3")[0] == "lo"  # the loopback testbed's hosts
    assert netcheck.check_interface("lo") is None
    msg = netcheck.check_interface("bogus0", "hostA")
    assert "network_interface 'bogus0' does not exist on hostA (its interfaces: lo" in msg
    ib = tmp_path / "infiniband"
    (ib / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (ib / "mlx5_1" / "ports" / "1").mkdir(parents=True)
    for ok in ("mlx5_0", "mlx5", "=mlx5_1", "mlx5_0:1,mlx5_1:1", "^mlx5_9"):
        assert netcheck.check_ib_hca(ok, "h", root=str(ib)) is None, ok
    assert "mlx5_2 not found on h (its InfiniBand devices: mlx5_0, mlx5_1)" in netcheck.check_ib_hca(
        "mlx5_0,mlx5_2", "h", root=str(ib))
    assert "mlx5_0:2 not found" in netcheck.check_ib_hca("mlx5_0:2", "h", root=str(ib))
    assert "=mlx5" in netcheck.check_ib_hca("=mlx5", "h", root=str(ib))
    assert "h has no InfiniBand devices" in netcheck.check_ib_hca("mlx5_0", "h", root=str(tmp_path / "none"))


def test_env_binding_on_the_node():
    env, why = netcheck.bind_env({"GLOO_SOCKET_IFNAME": LATE_IFNAME, "T": f"{RUN_DIR_VAR}/stacks/x_", "K": "v"},
                                 "/run/dir", "127.0.0.1")
    assert why is None and env == {"GLOO_SOCKET_IFNAME": "lo", "T": "/run/dir/stacks/x_", "K": "v"}
    env, why = netcheck.bind_env({"GLOO_SOCKET_IFNAME": LATE_IFNAME}, "/r", "no-such-host.invalid", "h")
    assert "network_interface auto: cannot resolve the main node 'no-such-host.invalid'" in why


def test_wait_reachable_answers_refuses_and_drops():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    assert netcheck.wait_reachable("127.0.0.1", port, 2.0) is None
    srv.close()
    t0 = time.monotonic()
    why = netcheck.wait_reachable("127.0.0.1", port, 0.5, refused_timeout=1.0)
    assert "cannot reach 127.0.0.1:" in why and "connection refused" in why and 0.9 < time.monotonic() - t0 < 3


def _plan(cluster: dict, procs: int = 1, **launch):
    import yaml
    from orchestrator.resources import profile_path
    from orchestrator.core.plan import PlanFacts, make_plan
    from orchestrator.core.spec import parse_cluster, parse_recipe
    c = parse_cluster(cluster)
    r = parse_recipe({"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/d.jsonl"},
                      "launch": dict(nodes=2, procs_per_node=procs, **launch)})
    return make_plan(r, c, PlanFacts(job_id="j", run_dir="/r", output_dir="/o", python=sys.executable, port=29500,
                                     accelerator="gpu", profile_name="multi_gpu",
                                     profile_config=yaml.safe_load(profile_path("multi_gpu").read_text()),
                                     hosts=c.ssh.hosts if c.ssh else ()))


def test_agent_binds_gpus_through_the_allocation_and_counts_them(tmp_path, monkeypatch):
    from orchestrator.node.agent import Agent
    plan = _plan({"kind": "slurm", "slurm": {"gpus_per_node": 4}}, procs=2, gpus=[1, 3], allow_idle_gpus=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # what SLURM gave this node
    a = Agent(tmp_path, plan, 1, "127.0.0.1")
    assert a.node_checks() is None and a.node_env()["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert a.node_env()["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/stacks/nccl_trace_rank_"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    why = Agent(tmp_path, plan, 1, "127.0.0.1").node_checks()
    assert "the plan binds GPU(s) 3 but this node may use only 2 (CUDA_VISIBLE_DEVICES=4,5)" in why
    whole = _plan({"kind": "slurm", "slurm": {"gpus_per_node": 2}}, procs=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    why = Agent(tmp_path, whole, 0, "127.0.0.1").node_checks()
    assert "may use 1 GPU(s) (CUDA_VISIBLE_DEVICES=0) but runs 2 process(es), one per GPU" in why
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert Agent(tmp_path, whole, 0, "127.0.0.1").node_checks() is None  # nothing says what the node has


def test_agent_refuses_a_bogus_interface_before_starting_anything(tmp_path):
    import dataclasses
    from orchestrator.node.rundir import RunDir
    plan = _plan({"kind": "slurm", "network_interface": "bogus0", "slurm": {"gpus_per_node": 1}})
    plan = dataclasses.replace(plan, run_dir=str(tmp_path))
    RunDir(tmp_path).write_text(RunDir.PLAN, plan.to_json())
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "orchestrator.node", str(tmp_path), "--node-rank", "1",
                        "--main-ip", "127.0.0.1"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and time.monotonic() - t0 < 10
    assert "PreflightError: network_interface 'bogus0' does not exist on" in r.stderr
    rec = RunDir(tmp_path).exit(1)
    assert rec.returncode == 2 and rec.stop_reason == ""  # its own failure, not a stop
    assert RunDir(tmp_path).agent(1) is None  # nothing was started


def test_probe_checks_interface_and_reports_gpus(monkeypatch):
    from orchestrator.node.probe import probe_spec
    monkeypatch.setenv("ORCHESTRATE_NVIDIA_SMI", str(REPO / "tests" / "fakes" / "nvidia-smi"))
    monkeypatch.setenv("FAKE_NVIDIA_GPUS", "2")
    r = probe_spec({"workdir": "/tmp", "ifname": "bogus0", "gpus": True, "ib_hca": "mlx5_0"})
    assert any("network_interface 'bogus0' does not exist" in p for p in r["problems"])
    assert any("NCCL_IB_HCA=mlx5_0" in p for p in r["problems"])
    assert [g["index"] for g in r["gpus"]] == [0, 1]
    r = probe_spec({"workdir": "/tmp", "ifname": "auto", "main": "127.0.0.1"})
    assert r["ifname"] == "lo" and not r["problems"]


def test_ssh_preflight_compares_the_hosts_gpus():
    from launchers.ssh.launcher import gpu_problems

    def host(n, visible=None):
        return {"gpus": [{"index": i, "name": "NVIDIA H100"} for i in range(n)], "visible": visible}
    want = {"procs_per_node": 8, "gpu_ids": [], "allow_idle": False, "declared": None}
    p = gpu_problems(want, {"gpu01": host(8), "gpu02": host(2)})
    assert [x.where for x in p] == ["ssh.hosts"]
    assert "different GPU counts (gpu01 8 x NVIDIA H100, gpu02 2 x NVIDIA H100)" in p[0].message
    assert gpu_problems(want, {"a": host(8), "b": host(8)}) == []
    p = gpu_problems(dict(want, procs_per_node=1), {"a": host(8), "b": host(8)})
    assert "7 of the 8 GPUs of each host would be idle" in p[0].message
    assert gpu_problems(dict(want, procs_per_node=1, allow_idle=True), {"a": host(8), "b": host(8)}) == []
    p = gpu_problems(want, {"a": host(8, visible=["0", "1"]), "b": host(8, visible=["0", "1"])})
    assert "8 processes per node, but each host gives the job 2 GPU(s)" in p[0].message
    p = gpu_problems(dict(want, procs_per_node=2, gpu_ids=[0, 5]), {"a": host(8), "b": host(2)})
    assert p[0].where == "launch.gpus" and "b lack(s) some" in p[0].message
    p = gpu_problems(want, {"a": {"gpus": [], "gpu_error": "nvidia-smi exited 9"}, "b": host(8)})
    assert "a no GPU (nvidia-smi exited 9)" in p[0].message


def test_preflight_does_not_apply_outside_a_multi_rank_launch(monkeypatch, capsys):
    from orchestrator.node import preflight
    for k in ("WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", preflight.DONE_VAR, preflight.TIMEOUT_VAR):
        monkeypatch.delenv(k, raising=False)
    assert preflight.run_from_env() == 0 and preflight.check(30) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(preflight.TIMEOUT_VAR, "5")
    assert preflight.run_from_env() == 0  # no torchrun agent store to meet at: skipped
    assert capsys.readouterr().err == ""


def test_the_gpus_module_prints_its_inventory(monkeypatch):
    env = {"ORCHESTRATE_NVIDIA_SMI": str(REPO / "tests" / "fakes" / "nvidia-smi"), "FAKE_NVIDIA_GPUS": "2",
           "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "1"}
    r = subprocess.run([sys.executable, "-m", "orchestrator.node.gpus"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=60)
    inv = json.loads(r.stdout)
    assert len(inv["gpus"]) == 2 and inv["visible"] == ["1"] and inv["source"] == "nvidia-smi"


@pytest.mark.parametrize("value,ok", [("auto", True), ("eth0", True), ("ib0.8001", True), ("bond0:1", True),
                                      ("a" * 16, False), ("eth 0", False), ("../x", False)])
def test_interface_names_in_cluster_files(value, ok):
    from orchestrator.core.spec import parse_cluster
    from orchestrator.errors import ConfigError
    if ok:
        assert parse_cluster({"network_interface": value}).network_interface == value
    else:
        with pytest.raises(ConfigError):
            parse_cluster({"network_interface": value})

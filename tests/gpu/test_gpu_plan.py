"""GPU-aware planning without GPUs (docs/gpus.md): procs_per_node auto from each node's GPUs, idle GPUs and uneven
hosts refused with the numbers and hosts named, disjoint CUDA_VISIBLE_DEVICES for emulated local nodes, `gpus:`
subsets, network_interface auto/named, the env passthrough and the GPU plan's NCCL forensics. Golden renders in
tests/gpu/golden (UPDATE_GOLDEN=1 rewrites them). Pure, plus the CLI with a fake nvidia-smi."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.resources import profile_path
from orchestrator.core.jobplan import LATE_IFNAME, LaunchPlan
from orchestrator.core.plan import PlanFacts, make_plan
from orchestrator.core.render import render_files, summary
from orchestrator.core.spec import parse_cluster, parse_recipe, read_yaml
from orchestrator.errors import ConfigError
from helpers import assert_golden

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
FAKE_SMI = REPO / "tests" / "fakes" / "nvidia-smi"
RECIPE = {"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/data/sft.jsonl"},
          "trainer": {"max_steps": 30, "per_device_train_batch_size": 8, "max_length": 256, "output_dir": "/out/sft"},
          "launch": {"env": {"NCCL_DEBUG": "WARN"}}}


def recipe(**launch):
    return parse_recipe(dict(RECIPE, launch=dict(RECIPE["launch"], **launch)), source="gpu.yaml")


def facts(cluster, accelerator="gpu", profile="multi_gpu", **kw):
    return PlanFacts(job_id="gpu-job", run_dir="/shared/runs/gpu-job", output_dir="/out/sft",
                     python="/opt/venv/bin/python", port=29500, accelerator=accelerator, profile_name=profile,
                     profile_config=yaml.safe_load(profile_path(profile).read_text()),
                     model_facts={"num_attention_heads": 4, "num_key_value_heads": 2},
                     hosts=cluster.ssh.hosts if cluster.ssh else (), **kw)


def problems(e: ConfigError) -> dict[str, str]:
    return {p.where: p.message for p in e.problems}


def shipped(name: str):
    path = REPO / "cluster_configs" / f"{name}.yaml"
    return parse_cluster(read_yaml(str(path), "cluster"), str(path))


# ------------------------------------------------------------------------------ golden renders for auto
CASES = {
    # name: (launch, cluster dict, fact extras)
    "local_auto_8gpus_2nodes": ({"nodes": 2}, {}, {"gpu_inventory": {"localhost": 8}}),
    "ssh_auto_8_8": ({"nodes": 2, "env_passthrough": ["NCCL_"]},
                     {"kind": "ssh", "network_interface": "auto", "ssh": {"hosts": ["gpu01", "gpu02"]}},
                     {"gpu_inventory": {"gpu01": 8, "gpu02": 8},
                      "passthrough_env": {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_API_KEY": "s3cret"}}),
    "slurm_example_auto": ({"nodes": 4}, "slurm_example", {}),
    "slurm_subset_auto": ({"nodes": 2, "gpus": [0, 1], "allow_idle_gpus": True},
                          {"kind": "slurm", "network_interface": "ib0", "slurm": {"gpus_per_node": 4}}, {}),
}


def build(name):
    launch, cluster, extra = CASES[name]
    c = shipped(cluster) if isinstance(cluster, str) else parse_cluster(cluster, source=f"{name}-cluster.yaml")
    r = recipe(**launch)
    plan = make_plan(r, c, facts(c, **extra))
    return plan, dict(render_files(plan, r.to_dict()), **{"summary.txt": summary(plan) + "\n"})


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    plan, files = build(name)
    assert build(name)[1] == files  # deterministic
    assert_golden(GOLDEN / name, files)
    assert LaunchPlan.from_json(plan.to_json()) == plan


def test_auto_is_one_process_per_gpu():
    local, _ = build("local_auto_8gpus_2nodes")
    assert (local.procs_per_node, local.world_size, local.gpus_per_node) == (4, 8, 4)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in local.node_plans] == ["0,1,2,3", "4,5,6,7"]  # disjoint
    ssh, _ = build("ssh_auto_8_8")
    assert (ssh.procs_per_node, ssh.world_size) == (8, 16) and "CUDA_VISIBLE_DEVICES" not in ssh.node(0).env
    slurm, files = build("slurm_example_auto")
    assert (slurm.procs_per_node, slurm.world_size, slurm.gpus_per_node) == (8, 32, 8)
    assert "world      4 node(s) x 8 process(es) = 32" in files["summary.txt"]
    subset, files = build("slurm_subset_auto")
    assert subset.procs_per_node == 2 and subset.gpu_ids == (0, 1)
    assert subset.node(1).env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "CUDA_VISIBLE_DEVICES=0,1  # indices into the GPUs SLURM allocates" in files["nodes/1/command.txt"]
    cpu = make_plan(recipe(nodes=2), parse_cluster({}), facts(parse_cluster({}), accelerator="cpu"))
    assert cpu.procs_per_node == 1 and "CUDA_VISIBLE_DEVICES" not in cpu.node(0).env


# ------------------------------------------------------------------------------ errors with the numbers
def test_idle_gpus_on_the_shipped_slurm_example_are_a_plan_error():
    c = shipped("slurm_example")
    with pytest.raises(ConfigError) as e:
        make_plan(recipe(nodes=4, procs_per_node=1), c, facts(c))
    msg = problems(e.value)["launch.procs_per_node"]
    assert "7 of the 8 GPUs allocated per node would be idle" in msg
    assert "slurm.gpus_per_node = 8, launch.procs_per_node = 1; 28 idle GPUs on 4 node(s)" in msg
    assert "launch.allow_idle_gpus: true" in msg and "auto (8 per node)" in msg
    ok = make_plan(recipe(nodes=4, procs_per_node=1, allow_idle_gpus=True), c, facts(c))
    assert ok.world_size == 4 and ok.allow_idle_gpus
    with pytest.raises(ConfigError, match="9 processes per node but slurm.gpus_per_node = 8"):
        make_plan(recipe(nodes=4, procs_per_node=9), c, facts(c))


def test_the_cli_refuses_idle_gpus_on_the_shipped_example(tmp_path):
    env = dict(os.environ, ORCHESTRATE_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "render", "recipes/configs/sft_tiny.yaml", "--nodes",
                        "4", "--cluster", "cluster_configs/slurm_example.yaml", "--out", str(tmp_path / "out"),
                        "launch.procs_per_node=1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "7 of the 8 GPUs allocated per node would be idle" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "render", "recipes/configs/sft_tiny.yaml", "--nodes",
                        "4", "--cluster", "cluster_configs/slurm_example.yaml", "--out", str(tmp_path / "out2"),
                        "launch.procs_per_node=auto"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "world      4 node(s) x 8 process(es) = 32" in r.stdout


def test_hosts_with_different_gpu_counts_are_refused_by_name():
    c = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["gpu01", "gpu02"]}})
    with pytest.raises(ConfigError) as e:
        make_plan(recipe(nodes=2), c, facts(c, gpu_inventory={"gpu01": 8, "gpu02": 2}))
    assert "the hosts have different GPU counts (gpu01 8, gpu02 2)" in problems(e.value)["ssh.hosts"]
    same = make_plan(recipe(nodes=2, gpus=[0, 1]), c, facts(c, gpu_inventory={"gpu01": 8, "gpu02": 2}))
    assert same.procs_per_node == 2 and same.node(1).env["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(ConfigError, match="lack"):
        make_plan(recipe(nodes=2, gpus=[0, 2]), c, facts(c, gpu_inventory={"gpu01": 8, "gpu02": 2}))


def test_procs_beyond_gpus_and_idle_on_ssh_hosts():
    c = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a", "b"], "gpus_per_node": 4}})
    with pytest.raises(ConfigError, match="6 processes per node, but each host gives the job 4 GPU"):
        make_plan(recipe(nodes=2, procs_per_node=6), c, facts(c))
    with pytest.raises(ConfigError, match=r"3 of the 4 GPUs of each host would be idle .*6 idle GPUs on 2 node"):
        make_plan(recipe(nodes=2, procs_per_node=1), c, facts(c))
    assert make_plan(recipe(nodes=2), c, facts(c)).procs_per_node == 4  # declared: no host asked
    with pytest.raises(ConfigError, match="ssh.gpus_per_node: 4 declared, but the hosts have a 8, b 8"):
        make_plan(recipe(nodes=2), c, facts(c, gpu_inventory={"a": 8, "b": 8}))


def test_local_emulated_nodes_split_this_machines_gpus():
    c = parse_cluster({})
    p = make_plan(recipe(nodes=2, procs_per_node=2), c, facts(c, gpu_inventory={"localhost": 4}))
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in p.node_plans] == ["0,1", "2,3"]
    with pytest.raises(ConfigError, match=r"2 of this machine's 8 usable GPU\(s\) \(0,1,2,3,4,5,6,7\) would be idle"):
        make_plan(recipe(nodes=3), c, facts(c, gpu_inventory={"localhost": 8}))
    with pytest.raises(ConfigError, match=r"2 emulated node\(s\) x 3 process\(es\) = 6 need a GPU each"):
        make_plan(recipe(nodes=2, procs_per_node=3), c, facts(c, gpu_inventory={"localhost": 4}))
    # co-located jobs: GPUs bound to another running job are skipped
    busy = make_plan(recipe(nodes=2), c, facts(c, gpu_inventory={"localhost": 8}, gpu_busy=(0, 1, 2, 3)))
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in busy.node_plans] == ["4,5", "6,7"]
    assert any("bound to other running jobs" in w for w in busy.warnings)
    subset = make_plan(recipe(nodes=2, gpus=[1, 3, 5, 7]), c, facts(c, gpu_inventory={"localhost": 8}))
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in subset.node_plans] == ["1,3", "5,7"]
    with pytest.raises(ConfigError, match=r"launch.gpus: GPU\(s\) 9 do not exist: this machine has 8"):
        make_plan(recipe(nodes=1, gpus=[9]), c, facts(c, gpu_inventory={"localhost": 8}))


def test_network_interface_auto_named_and_local():
    c = parse_cluster({"kind": "ssh", "network_interface": "auto", "ssh": {"hosts": ["a", "b"]}})
    p = make_plan(recipe(nodes=2, procs_per_node=1), c, facts(c, accelerator="cpu"))
    assert p.node(0).env["GLOO_SOCKET_IFNAME"] == LATE_IFNAME and p.network_interface == "auto"
    local = make_plan(recipe(nodes=2), parse_cluster({"network_interface": "auto"}),
                      facts(parse_cluster({}), accelerator="cpu"))
    assert local.node(0).env["GLOO_SOCKET_IFNAME"] == "lo"  # emulated nodes meet on loopback
    with pytest.raises(ConfigError, match="network_interface: must be a network interface name"):
        parse_cluster({"network_interface": "eth0; rm -rf /"})


def test_env_passthrough_names_only_and_never_secrets():
    plan, files = build("ssh_auto_8_8")
    assert plan.env_passthrough == ("NCCL_IB_HCA",) and plan.node(0).env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert "env        from the submit environment (launch.env_passthrough): NCCL_IB_HCA" in files["summary.txt"]
    assert all("s3cret" not in text and "NCCL_API_KEY=" not in text for text in files.values())
    assert "NCCL_API_KEY not passed (secret-looking" in files["summary.txt"]


def test_gpu_plans_carry_nccl_forensics_and_the_preflight_timeout():
    plan, files = build("slurm_example_auto")
    env = plan.node(0).env
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "${RUN_DIR}/stacks/nccl_trace_rank_"
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "${RUN_DIR}/stacks/nccl_pipe_rank_"
    shown = files["nodes/0/command.txt"]
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/shared/runs/gpu-job/stacks/nccl_trace_rank_" in shown
    assert env["ORCHESTRATE_PREFLIGHT_TIMEOUT"] == "30"
    off = make_plan(parse_recipe(dict(RECIPE, health={"preflight_timeout": 0}), source="x.yaml"),
                    parse_cluster({}), facts(parse_cluster({}), accelerator="cpu"))
    assert off.node(0).env["ORCHESTRATE_PREFLIGHT_TIMEOUT"] == "0"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in off.node(0).env  # CPU
    with pytest.raises(ConfigError, match="health.preflight_timeout: must be a number >= 0"):
        parse_recipe(dict(RECIPE, health={"preflight_timeout": -1}))


# ------------------------------------------------------------------------------ this machine through the CLI
def test_cli_emulated_nodes_get_disjoint_devices_from_a_fake_nvidia_smi(tmp_path, fake_local_gpus):
    fake_local_gpus(8)
    env = dict(os.environ, ORCHESTRATE_HOME=str(tmp_path / "home"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "render", "recipes/configs/sft_tiny.yaml", "--nodes",
                        "2", "--out", str(out), "launch.procs_per_node=auto"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "world      2 node(s) x 4 process(es) = 8" in r.stdout
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in (out / "nodes/0/command.txt").read_text()
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in (out / "nodes/1/command.txt").read_text()
    # the submitter's own CUDA_VISIBLE_DEVICES is what this machine gives: 2 GPUs, one per node
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "render", "recipes/configs/sft_tiny.yaml", "--nodes",
                        "2", "--out", str(tmp_path / "out2"), "launch.procs_per_node=auto"], cwd=REPO,
                       env=dict(env, CUDA_VISIBLE_DEVICES="5,6"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "world      2 node(s) x 1 process(es) = 2" in r.stdout, r.stderr


def test_detect_accelerator_and_inventory(fake_local_gpus, monkeypatch):
    from orchestrator import api
    from orchestrator.node import gpus
    fake_local_gpus(3)
    inv = gpus.inventory()
    assert inv["source"] == "nvidia-smi" and [g["index"] for g in inv["gpus"]] == [0, 1, 2]
    assert inv["gpus"][0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "550.54.15"}
    assert api.detect_accelerator(parse_cluster({})) == "gpu"
    monkeypatch.setenv("FAKE_NVIDIA_GPUS", "0")
    assert api.detect_accelerator(parse_cluster({})) == "cpu"
    monkeypatch.setenv("FAKE_NVIDIA_FAIL", "1")
    assert "has failed" in gpus.inventory()["error"]


def test_busy_gpus_of_live_local_jobs(tmp_path, monkeypatch):
    """GPUs another live local job's node agent leases (core.leases, whoever submitted it) are busy for the next job's
    plan; the lease ends with its holder process, and the GPUs are free again."""
    import signal
    from orchestrator import api
    from orchestrator.core.leases import LOCAL_HOST, node_locks
    monkeypatch.setenv("ORCHESTRATE_LEASE_DIR", str(tmp_path / "leases"))
    assert api.busy_local_gpus() == ()
    hold = ("import sys, time\nfrom orchestrator.core.leases import LOCAL_HOST, node_locks\n"
            "from orchestrator.node.lease import take\n"
            "h, _ = take(list(node_locks(LOCAL_HOST, (4, 5, 6, 7))), {'job': 'j1'}, LOCAL_HOST)\n"
            "print(h is not None, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", hold], cwd=REPO, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert p.stdout.readline().strip() == "True"
        assert api.busy_local_gpus() == (4, 5, 6, 7)
        plan = make_plan(recipe(nodes=1), parse_cluster({}), facts(parse_cluster({}), gpu_inventory={"localhost": 8},
                                                                   gpu_busy=api.busy_local_gpus()))
        assert plan.node_plans[0].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert node_locks(LOCAL_HOST, (0, 1, 2, 3))[1].name == "host-localhost.gpu0.lock"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert api.busy_local_gpus() == ()


def test_ssh_jobs_on_a_gpu_subset_of_their_main_host_get_a_port_of_their_own():
    """Two SSH jobs that each lease some GPUs of the same main host (core.leases) run at once: each rendezvous on
    its own port (core.jobplan.job_port of its job id, also in every node's accelerate config), stable for the job.
    A job of whole hosts, or one that gives launch.port, keeps the port as planned."""
    from orchestrator.core.jobplan import job_port
    c = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a", "b"], "gpus_per_node": 8}})
    sub = recipe(nodes=2, gpus=[0, 1], allow_idle_gpus=True)
    p1, p2 = (make_plan(sub, c, dataclasses.replace(facts(c), job_id=j)) for j in ("sweep-p0", "sweep-p1"))
    assert p1.node(0).env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p1.port == job_port(29500, "sweep-p0") != p2.port == job_port(29500, "sweep-p1")
    assert 30501 <= p1.port < 32001
    assert p1.port == make_plan(sub, c, dataclasses.replace(facts(c), job_id="sweep-p0")).port
    assert {n.accelerate_config["main_process_port"] for n in p1.node_plans} == {p1.port}
    assert make_plan(recipe(nodes=2), c, facts(c)).port == 29500  # whole hosts: nobody else on the main host
    given = make_plan(recipe(nodes=2, gpus=[0, 1], allow_idle_gpus=True, port=29600), c,
                      dataclasses.replace(facts(c), port=29600))  # (api.prepare: a given launch.port is the facts')
    assert given.port == 29600
    assert job_port(29500, "4242") == 29500 + 1001 + 4242 % 1500  # a SLURM job id counts as it is

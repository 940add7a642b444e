"""Rendered files: golden (byte-for-byte, deterministic), loadable by accelerate's own config loader,
and with the same profile blocks TRL ships under the same names. UPDATE_GOLDEN=1 rewrites the goldens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from orchestrator.resources import profile_path
from orchestrator.core.plan import PlanFacts, make_plan
from orchestrator.core.render import render_files, summary
from orchestrator.core.spec import parse_cluster, parse_recipe
from helpers import assert_golden

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RECIPE = {"recipe": "sft", "model": {"name_or_path": "tiny-llama", "attn_implementation": "sdpa"},
          "data": {"path": "/data/sft.jsonl"},
          "trainer": {"max_steps": 30, "per_device_train_batch_size": 8, "max_length": 256, "packing": True,
                      "pad_to_multiple_of": 4, "output_dir": "/out/sft"},
          "launch": {"secret_env": ["HF_TOKEN"], "env": {"NCCL_DEBUG": "WARN"}}}
CASES = {
    # name: (profile, cluster dict, nodes, procs, accelerator, parallelism, recipe kind)
    "local_multi_gpu_cpu": ("multi_gpu", {}, 2, 1, "cpu", {}, "sft"),
    "ssh_zero3_gpu": ("zero3", {"kind": "ssh", "ssh": {"hosts": "gpu[01-02]"}}, 2, 8, "gpu", {}, "sft"),
    "ssh_zero2_cpu": ("zero2", {"kind": "ssh", "network_interface": "lo", "ssh": {"hosts": ["127.0.0.2", "127.0.0.3"]}},
                      2, 1, "cpu", {}, "sft"),
    "slurm_fsdp2_gpu": ("fsdp2", {"kind": "slurm", "slurm": {"gpus_per_node": 4}}, 4, 4, "gpu", {}, "sft"),
    "slurm_context_parallel": ("context_parallel", {"kind": "slurm", "slurm": {"gpus_per_node": 4}}, 2, 4, "gpu",
                               {"cp": 2}, "cp"),
    "local_alst_ulysses": ("alst_ulysses", {}, 1, 4, "gpu", {"sp": 4}, "cp"),
}


def build(name):
    profile, cluster, nodes, procs, acc, par, kind = CASES[name]
    d = dict(RECIPE, recipe=kind, launch=dict(RECIPE["launch"], profile=profile, nodes=nodes, procs_per_node=procs,
                                              parallelism=par))
    recipe = parse_recipe(d, source=f"{name}.yaml")
    c = parse_cluster(cluster, source=f"{name}-cluster.yaml")
    cfg = yaml.safe_load(profile_path(profile).read_text())
    facts = PlanFacts(job_id=f"{name}-job", run_dir=f"/shared/runs/{name}-job", output_dir="/out/sft",
                      python="/opt/venv/bin/python", port=29500, accelerator=acc, profile_name=profile,
                      profile_config=cfg, model_facts={"num_attention_heads": 4, "num_key_value_heads": 2},
                      hosts=c.ssh.hosts if c.ssh else ())
    plan = make_plan(recipe, c, facts)
    return plan, render_files(plan, recipe.to_dict())


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    plan, files = build(name)
    files = dict(files, **{"summary.txt": summary(plan) + "\n"})
    assert build(name)[1] == render_files(plan, parse_recipe(  # deterministic: same input, same bytes
        dict(RECIPE, recipe=CASES[name][6], launch=dict(RECIPE["launch"], profile=CASES[name][0], nodes=CASES[name][2],
             procs_per_node=CASES[name][3], parallelism=CASES[name][5])), source=f"{name}.yaml").to_dict())
    assert_golden(GOLDEN / name, files)
    assert "HF_TOKEN=***" in files["nodes/0/command.txt"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_configs_load_through_accelerate(tmp_path, name):
    from accelerate.commands.config.config_args import load_config_from_file
    plan, files = build(name)
    for node in plan.node_plans:
        path = tmp_path / f"{node.node_rank}.yaml"
        path.write_text(files[f"nodes/{node.node_rank}/accelerate.yaml"])
        loaded = load_config_from_file(str(path))
        assert loaded.machine_rank == node.node_rank
        assert loaded.num_processes == plan.world_size and loaded.num_machines == plan.nodes
        assert loaded.main_process_port == 29500
        assert str(loaded.distributed_type).split(".")[-1] == plan.distributed_type


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_agent_keeps_a_rendered_config_only_when_it_is_what_it_would_write(tmp_path, name):
    """The node agent binds its rank and the main address into its accelerate config; where those are the plan's own
    it keeps the submitter's rendering (no YAML writer on its start): only when that is byte for byte what it would
    write."""
    from orchestrator.core.accelconf import accelerate_config_text
    from orchestrator.node.agent import Agent, bind_main_ip
    plan, files = build(name)
    for node in plan.node_plans:
        path = tmp_path / "nodes" / str(node.node_rank) / "accelerate.yaml"
        path.parent.mkdir(parents=True)
        path.write_text(files[f"nodes/{node.node_rank}/accelerate.yaml"])
        main_ip = bind_main_ip(None, plan.main_host, {"SLURM_JOB_NODELIST": "gpu[07-08]"})  # (SLURM: the first)
        agent = Agent(tmp_path, plan, node.node_rank, main_ip, rendered=True)
        want = accelerate_config_text(dict(node.accelerate_config, machine_rank=node.node_rank,
                                           main_process_ip=main_ip), plan.job_id, node.node_rank, plan.nodes)
        assert agent.write_config() == path and path.read_text() == want


@pytest.mark.parametrize("profile", ["multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2"])
def test_profile_blocks_match_trl(profile):
    import trl
    shipped = yaml.safe_load((Path(trl.__file__).parent / "accelerate_configs" / f"{profile}.yaml").read_text())
    ours = yaml.safe_load(profile_path(profile).read_text())
    assert ours == shipped
    recipe = parse_recipe(dict(RECIPE, launch={"profile": profile, "nodes": 2, "procs_per_node": 8}))
    facts = PlanFacts(job_id="j", run_dir="/r", output_dir="/o", python="python", port=1234, accelerator="gpu",
                      profile_name=profile, profile_config=ours)
    rendered = make_plan(recipe, parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a", "b"]}}),
                         dataclasses.replace(facts, hosts=("a", "b"))).node_plans[1].accelerate_config
    for block in ("deepspeed_config", "fsdp_config", "distributed_type", "use_cpu", "mixed_precision"):
        assert rendered.get(block) == shipped.get(block), block


def test_accelerate_key_list_in_sync():
    from accelerate.commands.config.config_args import ClusterConfig
    from orchestrator.core.plan import ACCELERATE_KEYS
    assert {f.name for f in dataclasses.fields(ClusterConfig)} <= ACCELERATE_KEYS

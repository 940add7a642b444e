"""Rendered files of own-code jobs (`run:`), golden byte for byte like the built-in recipes' (test_render_golden):
a script with list args on SSH hosts, and a `trl: sft` job with mapping args on SLURM. UPDATE_GOLDEN=1 rewrites
them. Pure: fixed facts stand for the installed TRL (the subcommand's module and its config's defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.resources import profile_path
from orchestrator.core.plan import PlanFacts, make_plan
from orchestrator.core.render import render_files, summary
from orchestrator.core.spec import parse_cluster, parse_job
from helpers import assert_golden

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TRL = {"sft": {"module": "trl.scripts.sft", "config": "SFTConfig", "training": True, "options": None}}
SFT_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_length": 1024, "bf16": None,
                "use_cpu": False, "pad_to_multiple_of": None}
CASES = {
    # name: (job, cluster, accelerator, facts)
    "own_script_ssh_cpu": (
        {"run": {"script": "/home/team/proj/train.py",
                 "args": ["--model_name_or_path", "/models/tiny", "--data", "/data/sft.jsonl", "--learning_rate",
                          "2e-5", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                          "--max_length", "256", "--output_dir", "/out/own", "--use_cpu"]},
         "launch": {"profile": "zero2", "nodes": 2, "procs_per_node": 1, "secret_env": ["HF_TOKEN"]},
         "health": {"stall_timeout": 300}},
        {"kind": "ssh", "network_interface": "lo", "ssh": {"hosts": ["127.0.0.2", "127.0.0.3"]}}, "cpu",
        {"output_dir": "/out/own"}),
    "own_trl_sft_slurm_gpu": (
        {"run": {"trl": "sft", "args": {"model_name_or_path": "Qwen/Qwen2.5-0.5B", "dataset_name": "trl-lib/Capybara",
                                        "learning_rate": 2e-5, "packing": True, "max_length": 2048,
                                        "per_device_train_batch_size": 2, "output_dir": "/shared/out/sft",
                                        "report_to": ["wandb"]}},
         "checkpoint": {"resume": "never"},
         "launch": {"profile": "fsdp2", "nodes": 2, "procs_per_node": 4, "env": {"NCCL_DEBUG": "WARN"}}},
        {"kind": "slurm", "slurm": {"gpus_per_node": 4}}, "gpu",
        {"output_dir": "/shared/out/sft", "run_module": "trl.scripts.sft", "trainer_defaults": SFT_DEFAULTS}),
}


def build(name):
    data, cluster, acc, extra = CASES[name]
    spec = parse_job(data, source=f"{name}.yaml", trl_commands=lambda: TRL)
    c = parse_cluster(cluster, source=f"{name}-cluster.yaml")
    profile = spec.launch.profile
    facts = PlanFacts(job_id=f"{name}-job", run_dir=f"/shared/runs/{name}-job", python="/opt/venv/bin/python",
                      port=29500, accelerator=acc, profile_name=profile,
                      profile_config=yaml.safe_load(profile_path(profile).read_text()),
                      hosts=c.ssh.hosts if c.ssh else (), **extra)
    plan = make_plan(spec, c, facts)
    return plan, dict(render_files(plan, spec.to_dict()), **{"summary.txt": summary(plan) + "\n"})


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    plan, files = build(name)
    assert build(name)[1] == files  # deterministic: same input, same bytes
    assert_golden(GOLDEN / name, files)


def test_golden_commands_say_what_runs():
    plan, files = build("own_script_ssh_cpu")
    assert files["nodes/1/command.txt"].endswith(
        "/opt/venv/bin/python -m accelerate.commands.launch --config_file "
        "/shared/runs/own_script_ssh_cpu-job/nodes/1/accelerate.yaml /home/team/proj/train.py --model_name_or_path "
        "/models/tiny --data /data/sft.jsonl --learning_rate 2e-5 --per_device_train_batch_size 4 "
        "--gradient_accumulation_steps 2 --max_length 256 --output_dir /out/own --use_cpu\n")
    assert "HF_TOKEN=***" in files["nodes/0/command.txt"] and plan.effective_batch == 16
    plan, files = build("own_trl_sft_slurm_gpu")
    assert " -m trl.scripts.sft --model_name_or_path Qwen/Qwen2.5-0.5B " in files["nodes/0/command.txt"]
    assert "ORCHESTRATE_RESUME=never" in files["nodes/0/command.txt"]
    assert plan.tokens_per_step == 2 * 1 * 8 * 2048 and plan.tokens_per_step_exact

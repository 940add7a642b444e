"""Shared fixtures for the recipe tests: offline env, a private tiny-model cache, recipe configs built
from the shipped YAMLs, and a launcher that runs recipes the way the node agent does
(`python -m accelerate.commands.launch --config_file X -m recipes.run RECIPE`).

Every launch carries its own ORCHESTRATE_JOB_TOKEN (as under the node agent), registered with `job_guard`: when a
test ends, pass or fail, every process of its launches is gone, ranks included (torchrun starts them in sessions of
their own, out of reach of the launcher's group). `p.token` finds a rank: proctools.marked_ranks(p.token)."""

from __future__ import annotations

import copy
import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import kill_tree
from orchestrator.node.proctools import TOKEN_VAR, kill_marked

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "recipes" / "configs"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
os.environ.update(OFFLINE)

ACCELERATE = {
    "multi_gpu": {"distributed_type": "MULTI_GPU"},  # torchrun path; the recipe trains on CPU with gloo
    "zero2": {"distributed_type": "DEEPSPEED",
              "deepspeed_config": {"zero_stage": 2, "deepspeed_multinode_launcher": "standard",
                                   "gradient_accumulation_steps": 1, "offload_optimizer_device": "none",
                                   "offload_param_device": "none", "zero3_init_flag": False}},
    "fsdp2": {"distributed_type": "FSDP",
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_cpu_ram_efficient_loading": False, "fsdp_offload_params": False,
                              "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdp_activation_checkpointing": False}},
    "zero3": {"distributed_type": "DEEPSPEED",
              "deepspeed_config": {"zero_stage": 3, "deepspeed_multinode_launcher": "standard",
                                   "gradient_accumulation_steps": 1, "offload_optimizer_device": "none",
                                   "offload_param_device": "none", "zero3_init_flag": True,
                                   "zero3_save_16bit_model": True}},
    # GPU-only profiles (tests marked `gpu`): context parallelism on FSDP2, ALST/Ulysses on DeepSpeed
    "context_parallel": {"distributed_type": "FSDP",
                         "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                         "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                                         "fsdp_reshard_after_forward": True},
                         "parallelism_config": {"parallelism_config_dp_replicate_size": 1,
                                                "parallelism_config_dp_shard_size": 1,
                                                "parallelism_config_tp_size": 1,
                                                "parallelism_config_cp_size": 2,
                                                "parallelism_config_cp_backend": "torch"}},
    "alst_ulysses": {"distributed_type": "DEEPSPEED",
                     "deepspeed_config": {"zero_stage": 3, "deepspeed_multinode_launcher": "standard",
                                          "gradient_accumulation_steps": 1, "zero3_init_flag": True},
                     "parallelism_config": {"parallelism_config_dp_replicate_size": 1,
                                            "parallelism_config_dp_shard_size": 1,
                                            "parallelism_config_tp_size": 1,
                                            "parallelism_config_sp_size": 2,
                                            "parallelism_config_sp_backend": "deepspeed"}},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("orchestrate_cache"))
    os.environ["ORCHESTRATE_CACHE"] = d
    return d


@pytest.fixture
def recipe_cfg(tmp_path, tiny_cache):
    """cfg(name, **trainer_overrides) -> dict: a shipped tiny YAML with output_dir in tmp_path."""

    def make(name: str, **trainer) -> dict:
        cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
        cfg = copy.deepcopy(cfg)
        cfg["data"]["path"] = str(REPO / cfg["data"]["path"])
        cfg["trainer"]["output_dir"] = str(tmp_path / "out")
        cfg["trainer"].update(trainer)
        return cfg

    return make


def parse_result(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith("ORCHESTRATE_RESULT "):
            return json.loads(line[len("ORCHESTRATE_RESULT "):])
    return None


@pytest.fixture
def launch(tmp_path, tiny_cache, job_guard):
    """launch(cfg, profile, nprocs, env=None, timeout=240, wait=True) -> (rc, result, output), or with wait=False
    the Popen (in a session of its own; .log its output file, .token its ORCHESTRATE_JOB_TOKEN)."""

    def run(cfg: dict, profile: str = "multi_gpu", nprocs: int = 2, env: dict | None = None,
            timeout: int = 240, wait: bool = True, tag: str = "run"):
        acc = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "num_processes": nprocs,
               "machine_rank": 0, "main_process_ip": "127.0.0.1", "main_process_port": free_port(),
               "use_cpu": False, "mixed_precision": "no", "rdzv_backend": "static", "same_network": True,
               **copy.deepcopy(ACCELERATE[profile])}
        acc_path = tmp_path / f"{tag}_accelerate.yaml"
        acc_path.write_text(yaml.safe_dump(acc))
        recipe_path = tmp_path / f"{tag}_recipe.yaml"
        recipe_path.write_text(yaml.safe_dump(cfg))
        token = job_guard.token(f"recipes-{tag}-{secrets.token_hex(6)}")
        e = {**os.environ, **OFFLINE, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
             "ORCHESTRATE_ACCELERATOR": "cpu", "ORCHESTRATE_CACHE": tiny_cache, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": str(REPO), TOKEN_VAR: token, **(env or {})}
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc_path),
                "-m", "recipes.run", str(recipe_path)]
        log = open(tmp_path / f"{tag}.log", "w+")
        p = job_guard.spawn(argv, cwd=REPO, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        p.token = token
        if not wait:
            p.log = log
            return p
        try:
            rc = p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                kill_tree(p)
                p.wait()
            kill_marked(token, grace=1.0)  # a rank the launcher left behind (its own session)
        log.seek(0)
        out = log.read()
        log.close()
        return rc, parse_result(out), out

    return run

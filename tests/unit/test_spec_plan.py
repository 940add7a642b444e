"""Pure validation and planning: every bad input of the foundation issue is caught, reported
together with its key path, before anything is touched; good inputs plan the right sizes."""

from __future__ import annotations

import copy
import json
import time

import pytest

from orchestrator.errors import ConfigError
from orchestrator.core.hostlist import HostlistError, expand
from orchestrator.core.jobplan import LATE_MAIN_IP, LaunchPlan
from orchestrator.core.plan import PlanFacts, make_plan, parse_time_s
from orchestrator.core.render import summary
from orchestrator.core.spec import parse_cluster, parse_dotlist, parse_recipe

BASE = {"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/data/x.jsonl"},
        "trainer": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_length": 512}}
PROFILES = {
    "multi_gpu": {"distributed_type": "MULTI_GPU", "mixed_precision": "bf16", "num_processes": 8},
    "zero3": {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}},
    "fsdp2": {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}},
    "fsdp1": {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}},
}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}


def recipe(**over):
    d = copy.deepcopy(BASE)
    for path, value in over.items():
        node = d
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return parse_recipe(d, source="r.yaml")


def facts(profile="multi_gpu", accelerator="cpu", hosts=(), heads=HEADS, cfg=None):
    return PlanFacts(job_id="job-1", run_dir="/runs/job-1", output_dir="/out", python="/venv/bin/python", port=29500,
                     accelerator=accelerator, profile_name=profile, profile_config=cfg or PROFILES[profile],
                     model_facts=heads, hosts=tuple(hosts))


def problems(exc: ConfigError) -> dict[str, str]:
    return {p.where: p.message for p in exc.problems}


# ------------------------------------------------------------------------------ spec
def test_unknown_keys_at_any_depth_with_suggestions_all_reported_together():
    d = copy.deepcopy(BASE)
    d["modle"] = {}
    d["launch"] = {"nodez": 2, "parallelism": {"cpp": 2}}
    d["data"]["splitt"] = "train"
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, source="r.yaml")
    p = problems(e.value)
    assert p["modle"] == "unknown key (did you mean 'model'?)"
    assert p["launch.nodez"] == "unknown key (did you mean 'nodes'?)"
    assert p["launch.parallelism.cpp"] == "unknown key (did you mean 'cp'?)"
    assert p["data.splitt"] == "unknown key (did you mean 'split'?)"
    assert str(e.value).startswith("r.yaml: 4 problems: ")
    assert e.value.exit_code == 2


def test_trainer_keys_checked_against_trl_fields():
    fields = frozenset({"learning_rate", "max_steps", "max_length", "per_device_train_batch_size",
                        "gradient_accumulation_steps"})
    d = copy.deepcopy(BASE)
    d["trainer"]["learning_rat"] = 1e-4
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, trainer_fields=lambda kind: fields)
    assert problems(e.value)["trainer.learning_rat"] == "unknown sft trainer option (did you mean 'learning_rate'?)"


def test_activation_checkpointing_is_accepted_where_transformers_predates_it():
    """`activation_checkpointing` (transformers >= 5.2x) on a transformers that only has `gradient_checkpointing`:
    accepted (the recipe passes it under the older name), not 'unknown option'; other keys are still checked."""
    old = {"gradient_checkpointing": "bool", "max_length": "opt_int", "per_device_train_batch_size": "int",
           "gradient_accumulation_steps": "int"}
    d = copy.deepcopy(BASE)
    d["trainer"]["activation_checkpointing"] = False
    assert parse_recipe(d, trainer_fields=lambda kind: old).trainer["activation_checkpointing"] is False
    d["trainer"]["activation_checkpointing"] = "yes"
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, trainer_fields=lambda kind: old)
    assert problems(e.value)["trainer.activation_checkpointing"] == "must be true or false, got 'yes'"


def test_recipe_passes_activation_checkpointing_under_the_older_name():
    from dataclasses import dataclass

    from recipes.common import older_names

    @dataclass
    class Old:  # a TrainingArguments before activation_checkpointing
        gradient_checkpointing: bool = False
        max_length: int = 0

    @dataclass
    class New:
        activation_checkpointing: bool = False
        gradient_checkpointing: bool = False

    assert older_names(Old, {"activation_checkpointing": True, "max_length": 8}) == \
        {"gradient_checkpointing": True, "max_length": 8}
    assert older_names(New, {"activation_checkpointing": True}) == {"activation_checkpointing": True}


def test_both_names_of_the_checkpointing_switch_are_refused():
    d = copy.deepcopy(BASE)
    d["trainer"].update(activation_checkpointing=True, gradient_checkpointing=False)
    with pytest.raises(ConfigError) as e:
        parse_recipe(d)
    assert problems(e.value)["trainer.gradient_checkpointing"] == \
        "the same switch as trainer.activation_checkpointing: give one of them"


@pytest.mark.parametrize("fsdp_env,model,given,expect", [
    ("true", "Qwen/Qwen2.5-0.5B", {}, False),        # FSDP checkpoints: TRL's default (on) turned off
    ("", "Qwen/Qwen2.5-0.5B", {}, None),             # no FSDP checkpointing: TRL's default stands
    ("", "tiny-llama", {}, False),                   # tiny models: off
    ("true", "Qwen/Qwen2.5-0.5B", {"gradient_checkpointing": True}, None)])  # the user's own choice stands
def test_recipe_checkpointing_default(monkeypatch, fsdp_env, model, given, expect):
    """Under an FSDP profile that checkpoints activations (accelerate sets FSDP_ACTIVATION_CHECKPOINTING=true) the
    recipes turn the Trainer's checkpointing off unless the user set it: transformers refuses both at once."""
    from dataclasses import dataclass, field

    from recipes.common import Runtime, build_config

    @dataclass
    class Config:  # stands in for a TRL config: takes what build_config passes
        output_dir: str = ""
        activation_checkpointing: bool | None = None
        gradient_checkpointing: bool | None = None
        report_to: str = ""
        disable_tqdm: bool = False
        model_init_kwargs: dict = field(default_factory=dict)

    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", fsdp_env)
    cfg = {"recipe": "sft", "model": {"name_or_path": model}, "trainer": dict(given, output_dir="/tmp/out")}
    c = build_config(Config, cfg, Runtime(accelerator="gpu", engine="fsdp", world_size=2, rank=0, pg_timeout_s=60))
    assert c.activation_checkpointing is expect


@pytest.mark.parametrize("key", ["activation_checkpointing", "gradient_checkpointing"])
def test_double_activation_checkpointing_on_fsdp_is_refused(key):
    """transformers' Trainer raises at start-up when FSDP's own activation checkpointing and the training argument are
    both on: refused at plan time, naming the key."""
    cfg = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True}}
    with pytest.raises(ConfigError) as e:
        make_plan(recipe(**{f"trainer__{key}": True}), parse_cluster({}), facts("fsdp2", accelerator="gpu", cfg=cfg))
    assert problems(e.value)[f"trainer.{key}"].startswith("the FSDP profile already checkpoints activations")
    make_plan(recipe(**{f"trainer__{key}": False}), parse_cluster({}), facts("fsdp2", accelerator="gpu", cfg=cfg))


@pytest.mark.parametrize("path,value,needle", [
    ("launch__nodes", "two", "launch.nodes: must be an integer >= 1"),
    ("launch__nodes", 0, "launch.nodes: must be an integer >= 1, got 0"),
    ("launch__procs_per_node", 0, "launch.procs_per_node: must be an integer >= 1"),
    ("launch__port", 70000, "launch.port: must be a port number"),
    ("recipe", "ppo", "recipe: must be one of sft, dpo, cp, got 'ppo'"),
    ("model__dtype", "bf16", "model.dtype: must be one of auto, float32, bfloat16, float16"),
    ("checkpoint__save_on_signal", "yes", "checkpoint.save_on_signal: must be true or false"),
    ("launch__env", {"HF_TOKEN": "hf_abc"}, "launch.env.HF_TOKEN: looks like a secret"),
    ("launch__secret_env", ["not a name"], "launch.secret_env: must be a list of environment variable names"),
    ("launch__parallelism__cp", -1, "launch.parallelism.cp: must be an integer >= 1"),
])
def test_bad_values(path, value, needle):
    with pytest.raises(ConfigError) as e:
        recipe(**{path: value})
    assert needle in str(e.value)


def test_missing_required_keys():
    with pytest.raises(ConfigError) as e:
        parse_recipe({"model": {}, "data": {}})
    p = problems(e.value)
    assert p == {"recipe": "missing required key", "model.name_or_path": "missing required key",
                 "data.path": "missing required key"}


def test_dotlist_overrides_parse_and_reject_garbage():
    rec, clu, probs = parse_dotlist(["trainer.learning_rate=1e-4", "launch.nodes=2", "cluster.slurm.time=00:10:00"])
    assert rec == {"trainer": {"learning_rate": 1e-4}, "launch": {"nodes": 2}}
    assert clu == {"slurm": {"time": "00:10:00"}}
    assert probs == []
    _, _, probs = parse_dotlist(["nodes", "=3", "a..b=1"])
    assert [p.where for p in probs] == ["override 'nodes'", "override '=3'", "override 'a..b=1'"]


def test_cluster_blocks():
    c = parse_cluster({"kind": "ssh", "ssh": {"hosts": "gpu[01-03]"}}, source="c.yaml")
    assert c.ssh.hosts == ("gpu01", "gpu02", "gpu03") and c.ssh.strict_host_keys is True
    with pytest.raises(ConfigError, match="duplicate hosts: a"):
        parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a", "b", "a"]}})
    with pytest.raises(ConfigError, match="ssh.hosts: missing"):
        parse_cluster({"kind": "ssh", "ssh": {}})
    with pytest.raises(ConfigError, match="slurm: block given but kind is 'ssh'"):
        parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a"]}, "slurm": {}})
    with pytest.raises(ConfigError, match="kind: must be one of local, ssh, slurm"):
        parse_cluster({"kind": "k8s"})


def test_hostlist():
    assert expand("gpu[01-04,07]") == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
    assert expand("node[1-2],login") == ["node1", "node2", "login"]
    assert expand("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    for bad in ("gpu[1-", "gpu]", "gpu[3-1]", "gpu[a-b]", ""):
        with pytest.raises(HostlistError):
            expand(bad)


# ------------------------------------------------------------------------------ plan
def test_world_size_batch_and_per_node_configs():
    plan = make_plan(recipe(launch__nodes=2, launch__procs_per_node=2), parse_cluster({}), facts())
    assert plan.world_size == 4 and plan.data_parallel_size == 4
    assert plan.effective_batch == 4 * 2 * 4 and plan.tokens_per_step == 32 * 512 and not plan.tokens_per_step_exact
    for r, node in enumerate(plan.node_plans):
        c = node.accelerate_config
        assert (c["num_processes"], c["num_machines"], c["machine_rank"]) == (4, 2, r)
        assert (c["main_process_ip"], c["main_process_port"], c["rdzv_backend"]) == ("127.0.0.1", 29500, "static")
        # CPU: the torchrun path that really distributes, never MULTI_CPU + use_cpu (trains alone silently)
        assert c["distributed_type"] == "MULTI_GPU" and c["use_cpu"] is False and c["mixed_precision"] == "no"
        assert node.ranks == (2 * r, 2 * r + 1)
        assert node.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert LaunchPlan.from_json(plan.to_json()) == plan


def test_gpu_keeps_profile_precision_and_slurm_binds_late():
    slurm = parse_cluster({"kind": "slurm", "slurm": {"gpus_per_node": 8}})
    plan = make_plan(recipe(launch__nodes=4, launch__procs_per_node=8), slurm, facts(accelerator="gpu"))
    assert plan.main_host == LATE_MAIN_IP and all(n.host == "" for n in plan.node_plans)
    assert plan.node_plans[3].accelerate_config["mixed_precision"] == "bf16"
    assert plan.node_plans[3].accelerate_config["num_processes"] == 32


def test_parallelism_rules_all_reported():
    bad = recipe(launch__nodes=2, launch__procs_per_node=2, launch__parallelism={"dp_shard": 3, "cp": 2},
                 trainer__max_length=510, trainer__pad_to_multiple_of=6)
    with pytest.raises(ConfigError) as e:
        make_plan(bad, parse_cluster({}), facts("multi_gpu"))
    p = problems(e.value)
    assert "= 6, but nodes x procs_per_node = 4" in p["launch.parallelism"]
    assert "cp > 1 needs FSDP2" in p["launch.parallelism.cp"]
    assert p["model.attn_implementation"].startswith("context parallelism (cp > 1) needs 'sdpa'")
    assert p["trainer.max_length"] == "must be divisible by cp*2 = 4 (ring attention), got 510"
    assert p["trainer.pad_to_multiple_of"] == "must be divisible by cp*2 = 4 (ring attention), got 6"


def test_cp_on_fsdp2_plans_parallelism_config():
    r = recipe(recipe="cp", model__attn_implementation="sdpa", launch__nodes=2, launch__procs_per_node=2,
               launch__profile="fsdp2", launch__parallelism={"cp": 2}, trainer__pad_to_multiple_of=4)
    plan = make_plan(r, parse_cluster({}), facts("fsdp2", accelerator="gpu"))
    assert plan.parallelism == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 2, "sp": 1}
    pc = plan.node_plans[0].accelerate_config["parallelism_config"]
    assert pc["parallelism_config_cp_size"] == 2 and pc["parallelism_config_dp_shard_size"] == 2
    assert plan.data_parallel_size == 2


def test_sp_needs_deepspeed_and_divisible_heads():
    r = recipe(launch__procs_per_node=2, launch__parallelism={"sp": 2}, trainer__pad_to_multiple_of=2)
    with pytest.raises(ConfigError, match="sp > 1 .ALST/Ulysses. needs DeepSpeed"):
        make_plan(r, parse_cluster({}), facts("fsdp2"))
    r3 = recipe(launch__procs_per_node=3, launch__parallelism={"sp": 3}, trainer__max_length=513,
                trainer__pad_to_multiple_of=3)
    with pytest.raises(ConfigError) as e:
        make_plan(r3, parse_cluster({}), facts("zero3"))
    p = problems(e.value)
    assert p["launch.parallelism.sp"] == "the model's 4 attention heads are not divisible by sp = 3"
    ok = make_plan(r, parse_cluster({}), facts("zero3", accelerator="gpu"))
    assert ok.node_plans[0].accelerate_config["parallelism_config"]["parallelism_config_sp_size"] == 2


def test_cp_and_recipe_rules():
    with pytest.raises(ConfigError, match="recipe 'cp' needs cp > 1"):
        make_plan(recipe(recipe="cp"), parse_cluster({}), facts())
    with pytest.raises(ConfigError, match="cp and sp are exclusive"):
        make_plan(recipe(launch__procs_per_node=4, launch__parallelism={"cp": 2, "sp": 2}), parse_cluster({}),
                  facts("zero3"))


def test_more_nodes_than_hosts_and_slurm_limits():
    ssh = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a", "b"]}})
    with pytest.raises(ConfigError, match="3 nodes asked but cluster 'ssh' lists only 2 host"):
        make_plan(recipe(launch__nodes=3), ssh, facts(hosts=("a", "b")))
    plan = make_plan(recipe(launch__nodes=2), ssh, facts(hosts=("a", "b")))
    assert [n.host for n in plan.node_plans] == ["a", "b"] and plan.main_host == "a" and plan.spare_hosts == ()
    assert "spare_hosts" not in plan.to_dict()  # (plan.json keeps its bytes where there is nothing to say)
    spared = make_plan(recipe(launch__nodes=2), ssh, facts(hosts=("a", "b", "c", "d")))
    assert spared.spare_hosts == ("c", "d") and LaunchPlan.from_json(spared.to_json()) == spared
    assert json.loads(spared.to_json())["spare_hosts"] == ["c", "d"]
    assert "hosts      a, b run the job; spares (wait, take a failed host's place): c, d" in summary(spared)
    slurm = parse_cluster({"kind": "slurm", "slurm": {"gpus_per_node": 8, "max_gpus_per_node": 4, "time": "00:01:00",
                                                      "signal_lead_s": 120}})
    with pytest.raises(ConfigError) as e:
        make_plan(recipe(), slurm, facts(accelerator="gpu"))
    p = problems(e.value)
    assert "8 GPUs per node asked but cluster 'slurm' nodes have 4" in p["slurm.gpus_per_node"]
    assert "is not longer than the preemption signal lead" in p["slurm.time"]


def test_profile_must_be_an_accelerate_config():
    with pytest.raises(ConfigError, match="not an accelerate config: unknown keys distributed_typ"):
        make_plan(recipe(), parse_cluster({}), facts(cfg={"distributed_typ": "FSDP"}))
    with pytest.raises(ConfigError, match="distributed_type 'WARP' is not one of"):
        make_plan(recipe(), parse_cluster({}), facts(cfg={"distributed_type": "WARP"}))


def test_slurm_time_parsing():
    assert parse_time_s("90") == 5400 and parse_time_s("01:00:00") == 3600 and parse_time_s("1-02") == 93600
    assert parse_time_s("10:30") == 630 and parse_time_s("2-00:30:00") == 174600 and parse_time_s("x") is None


def test_1024_nodes_plan_and_render_fast():
    from orchestrator.core.render import render_files
    ssh = parse_cluster({"kind": "ssh", "ssh": {"hosts": "n[0001-1024]"}})
    r = recipe(launch__nodes=1024, launch__procs_per_node=8)
    t0 = time.perf_counter()
    plan = make_plan(r, ssh, facts("zero3", accelerator="gpu", hosts=ssh.ssh.hosts))
    files = render_files(plan, r.to_dict())
    dt = time.perf_counter() - t0
    assert len(files) == 2 + 2 * 1024 and plan.world_size == 8192
    assert plan.node_plans[1023].accelerate_config["machine_rank"] == 1023
    assert dt < 1.0, f"1024 nodes took {dt:.2f}s"

"""Own code (`run:` - issue #12): the block's schema, its errors (named by key, all together, exit 2 through the CLI),
overrides of its args, path resolution, and the plan's one path for built-in recipes, scripts, modules and TRL
subcommands (node command, effective batch from the args, what the plan adds to a TRL subcommand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator import api, trlfields
from orchestrator.resources import profile_path
from orchestrator.core.jobplan import RUN_DIR_VAR, LaunchPlan
from orchestrator.core.plan import RECIPE_ENTRY, PlanFacts, make_plan
from orchestrator.core.render import summary
from orchestrator.core.schema import rules
from orchestrator.core.spec import (RunJobSpec, RunSpec, load, parse_cluster, parse_job, parse_recipe, run_settings,
                                    trl_command_table)
from orchestrator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PROFILES = {name: yaml.safe_load(profile_path(name).read_text())
            for name in ("multi_gpu", "zero2", "fsdp2", "context_parallel")}
# A TRL command table and field kinds as trlfields gives them, small and fixed (no trl needed).
TABLE = {"sft": {"module": "trl.scripts.sft", "config": "SFTConfig", "training": True,
                 "options": ["--model_name_or_path", "--dataset_name", "--learning_rate", "--max_length",
                             "--per_device_train_batch_size", "--gradient_accumulation_steps", "--packing",
                             "--output_dir", "--bf16", "--use_cpu", "--pad_to_multiple_of", "--num_processes",
                             "--hub_token", "--gradient_checkpointing", "--report_to",
                             "--attn_implementation"]},
         "vllm-serve": {"module": "trl.scripts.vllm_serve", "config": None, "training": False, "options": None}}
KINDS = {"learning_rate": "float", "max_length": "opt_int", "per_device_train_batch_size": "int",
         "gradient_accumulation_steps": "int", "packing": "bool", "output_dir": "opt_str", "bf16": "opt_bool",
         "use_cpu": "bool", "pad_to_multiple_of": "opt_int", "seed": "int", "max_steps": "int"}
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_length": 1024, "bf16": None,
            "use_cpu": False, "pad_to_multiple_of": None}


NEEDS = {"model_name_or_path": "m", "dataset_name": "d"}  # what a trl sft job cannot run without (spec.TRL_NEEDS)


def job(run: dict, **rest) -> RunJobSpec:
    return parse_job({"run": run, **rest}, source="my_job.yaml", trainer_fields=lambda key: KINDS,
                     trl_commands=lambda: TABLE)


def problems(exc: ConfigError) -> dict[str, str]:
    return {p.where: p.message for p in exc.problems}


def bad(run: dict, **rest) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        job(run, **rest)
    assert e.value.exit_code == 2
    return problems(e.value)


def facts(accelerator="cpu", profile="multi_gpu", **kw) -> PlanFacts:
    return PlanFacts(job_id="j", run_dir="/runs/j", output_dir="/out", python="/venv/bin/python", port=29500,
                     accelerator=accelerator, profile_name=profile, profile_config=PROFILES[profile], **kw)


def plan(spec, cluster=None, **kw) -> LaunchPlan:
    return make_plan(spec, parse_cluster(cluster or {}), facts(**kw))


# ------------------------------------------------------------------------------ schema
def test_run_block_is_declared_once_as_a_dataclass():
    r = rules(RunSpec)
    assert set(r) == {"script", "module", "trl", "args"} and not any(x.required for x in r.values())
    assert r["args"].kind == "run_args" and r["module"].kind == "opt_module_name"
    assert set(rules(RunJobSpec)) == {"run", "checkpoint", "outputs", "launch", "health", "container", "notify",
                                      "sweep", "source", "output_dir"}
    assert rules(RunJobSpec)["source"].internal and rules(RunJobSpec)["output_dir"].internal


def test_list_args_stay_words_in_order_and_mapping_args_become_options():
    s = job({"script": "train.py", "args": ["--lr", 2e-5, "--flag", "--n=3", 5, True]})
    assert s.run.kind == "script" and s.run.argv() == ("--lr", "2e-05", "--flag", "--n=3", "5", "true")
    assert s.run.options() == {"lr": ("2e-05", "run.args[1]"), "flag": (None, "run.args[2]"), "n": ("3", "run.args[3]")}
    m = job({"module": "mypkg.train", "args": {"learning_rate": "2e-5", "bf16": False, "use_cpu": True,
                                                 "report_to": ["wandb", "tensorboard"], "--raw": 1}})
    assert m.run.argv() == ("--learning_rate", "2e-5", "--bf16", "false", "--use_cpu", "true",
                            "--report_to", "wandb", "tensorboard", "--raw", "1")
    assert run_settings(m.run)["learning_rate"] == 2e-5 and run_settings(m.run)["bf16"] is False
    assert job({"trl": "sft", "args": {"config": "c.yaml"}}).run.argv() == ("--config", "c.yaml")
    assert job({"script": "a.py"}).run.args == () and job({"script": "a.py", "args": None}).run.argv() == ()


def test_a_recipe_file_is_still_a_recipe():
    r = parse_job({"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/d.jsonl"}})
    assert r.recipe == "sft"
    with pytest.raises(ConfigError) as e:
        parse_job({"model": {}, "data": {}})
    assert problems(e.value)["recipe"] == "missing required key"


def test_resolved_job_round_trips_through_its_yaml():
    s = job({"trl": "sft", "args": {**NEEDS, "learning_rate": 1e-4, "report_to": ["a", "b"]}}, launch={"nodes": 2})
    d = s.to_dict()
    assert d["run"] == {"trl": "sft", "args": {**NEEDS, "learning_rate": 1e-4, "report_to": ["a", "b"]}}
    assert "source" not in d
    assert job(**yaml.safe_load(yaml.safe_dump(d))) == s


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("run,rest,where,message", [
    ({}, {}, "run", "give exactly one of script, module, trl"),
    ({"script": "a.py", "trl": "sft"}, {}, "run", "give exactly one of script, module, trl (got script, trl)"),
    ({"trl": "sfy"}, {}, "run.trl", "unknown TRL subcommand 'sfy' (did you mean 'sft'?); one of sft"),
    ({"trl": "vllm-serve"}, {}, "run.trl", "'vllm-serve' is not a training subcommand of TRL; one of sft"),
    ({"module": "my-pkg.train"}, {}, "run.module", "not a Python module name: 'my-pkg.train'"),
    ({"script": "a.py", "args": ["--a", "1", {"x": 1}]}, {}, "run.args[2]", "must be a string, number or boolean"),
    ({"script": "a.py", "args": ["--a", None]}, {}, "run.args[1]", "must be a string, number or boolean"),
    ({"script": "a.py", "args": {"a": {"b": 1}}}, {}, "run.args.a",
     "must be a string, number or boolean (or a list of them)"),
    ({"script": "a.py", "args": {"a": None}}, {}, "run.args.a",
     "must be a string, number or boolean (or a list of them)"),
    ({"script": "a.py", "args": "--a 1"}, {}, "run.args",
     "must be a list of arguments or a mapping option: value, got str"),
    ({"script": "a.py"}, {"recipe": "sft"}, "recipe",
     "give either recipe: (a built-in recipe) or run: (your own code), not both"),
    ({"script": "a.py"}, {"model": {"name_or_path": "m"}}, "model",
     "not used with run: (your code gets what it needs from run.args)"),
    ({"script": "a.py", "args": {"per_device_train_batch_size": "two"}}, {}, "run.args.per_device_train_batch_size",
     "must be an integer, got 'two'"),
    ({"script": "a.py", "args": ["--per_device_train_batch_size", "0"]}, {}, "run.args[1]",
     "must be an integer >= 1, got 0"),
    ({"script": "a.py", "args": {"packing": "maybe"}}, {}, "run.args.packing", "must be true or false, got 'maybe'"),
    ({"script": "a.py", "args": {"learning_rate": "fast"}}, {}, "run.args.learning_rate",
     "must be a number, got 'fast'"),
    ({"script": "a.py", "args": ["--seed"]}, {}, "run.args[0]", "needs a value"),
    ({"trl": "sft", "args": {**NEEDS, "learning_rat": 1}}, {}, "run.args.learning_rat",
     "not an option of trl sft (did you mean 'learning_rate'?)"),
    ({"trl": "sft", "args": {**NEEDS, "num_processes": 2}}, {}, "run.args.num_processes",
     "--num_processes is an `accelerate launch` option: orchestrate sets the launch from launch: (profile, nodes, "
     "procs_per_node, mixed_precision)"),
    ({"trl": "sft", "args": {**NEEDS, "hub_token": "hf_x"}}, {}, "run.args.hub_token",
     "looks like a secret: pass it by launch.secret_env"),
])
def test_bad_run_blocks_are_named_by_key(run, rest, where, message):
    assert bad(run, **rest) == {where: message}


def test_a_trl_subcommand_without_what_it_needs_is_refused_naming_it():
    """TRL's scripts take model and dataset as optional options and fail on every rank once started without them:
    refused here, each by the option to give (the table's options say which the subcommand has)."""
    assert bad({"trl": "sft"}) == {"run.args.model_name_or_path": "missing: trl sft needs a model",
                                   "run.args.dataset_name": "missing: trl sft needs a dataset"}
    assert bad({"trl": "sft", "args": ["--model_name_or_path", "m"]}) == {
        "run.args.dataset_name": "missing: trl sft needs a dataset"}
    table = {"grpo": {"module": "trl.scripts.grpo", "config": "GRPOConfig", "training": True,
                      "options": ["--model_name_or_path", "--dataset_name", "--datasets", "--reward_funcs",
                                  "--reward_model_name_or_path"]}}
    with pytest.raises(ConfigError) as e:
        parse_job({"run": {"trl": "grpo", "args": {"model_name_or_path": "m"}}}, trl_commands=lambda: table)
    assert problems(e.value) == {"run.args.dataset_name": "missing: trl grpo needs a dataset (this or --datasets)",
                                 "run.args.reward_funcs": "missing: trl grpo needs a reward (this or "
                                                          "--reward_model_name_or_path)"}
    given = {"model_name_or_path": "m", "datasets": "d", "reward_model_name_or_path": "r"}
    assert parse_job({"run": {"trl": "grpo", "args": given}}, trl_commands=lambda: table).run.trl == "grpo"
    # a TrlParser --config file may hold them: not read here, not refused
    assert job({"trl": "sft", "args": {"config": "sft.yaml"}}).run.trl == "sft"


def test_every_problem_reported_together():
    p = bad({"module": "a-b", "args": [1, {"x": 1}]}, launch={"nodes": 0}, data={"path": "x"})
    assert p == {"data": "not used with run: (your code gets what it needs from run.args)",
                 "launch.nodes": "must be an integer >= 1, got 0",
                 "run.module": "not a Python module name: 'a-b'",
                 "run.args[1]": "must be a string, number or boolean"}
    p = bad({"script": "a.py", "args": {"seed": "x", "max_steps": 0}}, launch={"nodes": 0})
    assert p == {"launch.nodes": "must be an integer >= 1, got 0", "run.args.seed": "must be an integer, got 'x'",
                 "run.args.max_steps": "must be -1 (no limit) or an integer >= 1, got 0"}


def test_own_script_options_are_free_and_numbers_in_strings_count():
    s = job({"script": "a.py", "args": {"my_own_flag": "x", "learning_rate": "1e-4", "use_cpu": "yes",
                                         "per_device_train_batch_size": "4"}})
    assert run_settings(s.run, KINDS) == {"my_own_flag": "x", "learning_rate": 1e-4, "use_cpu": True,
                                          "per_device_train_batch_size": 4}


def test_trl_subcommands_fall_back_to_a_fixed_list_without_trl():
    table = trl_command_table(None)
    assert {"sft", "dpo", "grpo", "kto", "reward", "rloo", "orpo", "vllm-serve", "env"} <= set(table)
    assert table["grpo"]["module"] == "trl.scripts.grpo" and not table["vllm-serve"]["training"]
    assert parse_job({"run": {"trl": "orpo", "args": {"anything_goes": 1}}}).run.trl == "orpo"  # options unknown
    with pytest.raises(ConfigError, match=r"run.trl: unknown TRL subcommand 'gpro' \(did you mean 'grpo'\?\)"):
        parse_job({"run": {"trl": "gpro"}})


# ------------------------------------------------------------------------------ through the CLI: exit 2, one line
@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """One ORCHESTRATE_HOME for the CLI runs below (its TRL cache is built once)."""
    home = tmp_path_factory.mktemp("run_block_home")
    return {**os.environ, "ORCHESTRATE_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("text,needle", [
    ("run: {script: nope.py}", "run.script: file not found: {cwd}/nope.py"),
    ("run: {script: sub}", "run.script: not a file: {cwd}/sub"),
    ("run: {trl: sfy}", "run.trl: unknown TRL subcommand 'sfy' (did you mean 'sft'?)"),
    ("run: {script: train.py, args: [--a, 1, {x: 1}]}", "run.args[2]: must be a string, number or boolean"),
    ("run: {script: train.py, trl: sft}", "run: give exactly one of script, module, trl"),
    ("run: {trl: sft, args: {learning_rat: 1}}", "run.args.learning_rat: not an option of trl sft (did you mean "
                                                 "'learning_rate'?)"),
    ("run: {trl: sft, args: {per_device_train_batch_size: two}}",
     "run.args.per_device_train_batch_size: must be an integer, got 'two'"),
    ("run: {script: train.py, args: [--output_dir, o]}\nrecipe: sft", "recipe: give either recipe:"),
    ("run: {trl: dpo}", "2 problems: run.args.model_name_or_path: missing: trl dpo needs a model; "
                        "run.args.dataset_name: missing: trl dpo needs a dataset (this or --datasets)"),
])
@pytest.mark.parametrize("command", ["render", "submit"])
def test_cli_refuses_bad_run_blocks_with_exit_2_and_one_line(tmp_path, cli_env, text, needle, command):
    """`render` and a real `submit` (2 local nodes): exit 2, one line naming the key, nothing written or recorded."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "bad.yaml").write_text(text + "\n")
    out = tmp_path / "out"
    home = Path(cli_env["ORCHESTRATE_HOME"])
    before = sorted(p.relative_to(home) for p in home.rglob("*") if "runs" in p.parts or p.name == "jobs.db")
    argv = ["render", "bad.yaml", "--out", str(out)] if command == "render" else ["submit", "bad.yaml", "--nodes", "2"]
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv],
                       cwd=tmp_path, env={**cli_env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orchestrate: error: bad.yaml: "), r.stderr
    assert needle.format(cwd=tmp_path.resolve()) in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "sub", "train.py"]  # no out/, no outputs/
    assert sorted(p.relative_to(home) for p in home.rglob("*") if "runs" in p.parts or p.name == "jobs.db") == before


def test_contract_doc_own_code_block_is_a_valid_job(tmp_path):
    """docs/CONTRACT.md's `run:` schema block (the defaults) parses as a job once its example script and args, given
    in its comments, are filled in."""
    text = (REPO / "docs" / "CONTRACT.md").read_text().split("## Own-code job YAML", 1)[1]
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert "e.g. train.py" in block and 'e.g. [--learning_rate, "2e-5"]' in block
    (tmp_path / "train.py").write_text("")
    data = yaml.safe_load(block)
    data["run"].update(script=str(tmp_path / "train.py"), args=["--learning_rate", "2e-5"])
    spec = parse_job(data, source="doc.yaml", trainer_fields=lambda key: KINDS, trl_commands=lambda: TABLE)
    assert isinstance(spec, RunJobSpec) and spec.run.kind == "script"
    assert spec.run.argv() == ("--learning_rate", "2e-5") and spec.health.stall_timeout == 300


def test_cli_render_shows_the_run_kind_and_the_exact_command(tmp_path, cli_env):
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "run": {"script": "train.py", "args": {"learning_rate": "2e-5", "per_device_train_batch_size": 4,
                                                "max_length": 64}},
        "launch": {"profile": "zero2", "nodes": 2, "procs_per_node": 2}, "health": {"stall_timeout": 300}},
        sort_keys=False))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "render", "job.yaml", "--out", str(out), "--nodes",
                        "4", "run.args.learning_rate=1e-5"], cwd=tmp_path, env={**cli_env, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    script = tmp_path.resolve() / "train.py"
    assert f"(own code: script {script}, job 'job', local cluster 'local'" in r.stdout
    assert "batch      4 per device x 1 accumulation x 8 = 32 sequences per optimizer step" in r.stdout
    assert "tokens     2,048 (at most) per step (max_length 64)" in r.stdout
    cmd = (f"-m accelerate.commands.launch --config_file {out}/nodes/3/accelerate.yaml {script} --learning_rate 1e-05 "
           "--per_device_train_batch_size 4 --max_length 64")
    assert cmd in (out / "nodes/3/command.txt").read_text()
    assert f"command    {sys.executable} " + cmd.replace("nodes/3", "nodes/0") in r.stdout
    p = json.loads((out / "plan.json").read_text())
    assert p["run_kind"] == "script" and p["run_target"] == str(script) and p["nodes"] == 4
    assert yaml.safe_load((out / "recipe.yaml").read_text())["run"]["args"]["learning_rate"] == 1e-5


# ------------------------------------------------------------------------------ overrides
def test_dotlist_overrides_reach_mapping_and_list_args(tmp_path):
    f = tmp_path / "j.yaml"
    f.write_text("run: {trl: sft, args: {learning_rate: 2e-5, packing: false}}\n")
    s, _ = load(str(f), overrides=["run.args.learning_rate=1e-5", "run.args.max_length=512", "run.args.packing=true",
                                   "run.args.model_name_or_path=m", "run.args.dataset_name=d"])
    assert s.run.args == {"learning_rate": 1e-5, "packing": True, "max_length": 512, **NEEDS}
    f.write_text("run: {script: t.py, args: [data.jsonl, --learning_rate, '2e-5', --flag, --x=1]}\n")
    s, _ = load(str(f), overrides=["run.args.learning_rate=1e-5", "run.args.flag=false", "run.args.x=2",
                                   "run.args.new=true", "run.args.0=other.jsonl"])
    assert s.run.args == ("other.jsonl", "--learning_rate", "1e-05", "--flag", "false", "--x=2", "--new", "true")
    with pytest.raises(ConfigError, match="run.args.9: run.args has 5 words"):
        f.write_text("run: {script: t.py, args: [a, b, c, d, e]}\n")
        load(str(f), overrides=["run.args.9=x"])


# ------------------------------------------------------------------------------ paths
def test_paths_resolve_against_the_submit_directory(tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "data").mkdir()
    s = job({"script": "train.py", "args": ["--model_name_or_path", "./model", "--data", "data", "--hub", "org/model",
                                            "--logging_dir=logs", "--output_dir", "out/run1", "--n", "3"]})
    r = api.resolve_paths(s, tmp_path)
    cwd = tmp_path.resolve()
    assert r.run.script == str(cwd / "train.py")
    assert r.run.args == ("--model_name_or_path", str(cwd / "model"), "--data", str(cwd / "data"), "--hub",
                          "org/model", f"--logging_dir={cwd / 'logs'}", "--output_dir", str(cwd / "out/run1"),
                          "--n", "3")
    assert r.output_dir == str(cwd / "out/run1")
    # no --output_dir: the default, added to a TRL subcommand only
    plain = api.resolve_paths(job({"script": "train.py", "args": {"data": "~/d.jsonl"}}), tmp_path)
    assert plain.output_dir == str(cwd / "outputs/my_job") and "output_dir" not in plain.run.args
    assert plain.run.args["data"] == str(Path("~/d.jsonl").expanduser())
    trl = api.resolve_paths(job({"trl": "sft", "args": {**NEEDS, "dataset_name": "trl-lib/Capybara"}}), tmp_path)
    assert trl.run.args == {**NEEDS, "dataset_name": "trl-lib/Capybara", "output_dir": str(cwd / "outputs/my_job")}
    with pytest.raises(ConfigError) as e:
        api.resolve_paths(job({"script": "missing.py"}), tmp_path)
    assert problems(e.value) == {"run.script": f"file not found: {cwd / 'missing.py'}"}


def test_model_facts_come_from_the_model_dir_the_args_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 6}))
    assert api.model_facts(job({"script": "a.py", "args": {"model_name_or_path": str(tmp_path)}})) == \
        {"num_attention_heads": 6}
    assert api.model_facts(job({"script": "a.py", "args": ["--x", "1"]})) is None


# ------------------------------------------------------------------------------ plan
def test_one_node_command_path_for_every_kind():
    base = ("/venv/bin/python", "-m", "accelerate.commands.launch", "--config_file",
            f"{RUN_DIR_VAR}/nodes/1/accelerate.yaml")
    recipe = parse_recipe({"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/d.jsonl"},
                           "launch": {"nodes": 2}})
    assert plan(recipe).node(1).command == (*base, *RECIPE_ENTRY)
    script = job({"script": "/src/train.py", "args": ["--a", "1"]}, launch={"nodes": 2})
    assert plan(script).node(1).command == (*base, "/src/train.py", "--a", "1")
    module = job({"module": "mypkg.train", "args": {"a": True}}, launch={"nodes": 2})
    assert plan(module).node(1).command == (*base, "-m", "mypkg.train", "--a", "true")
    trl = job({"trl": "sft", "args": {**NEEDS, "output_dir": "/o"}}, launch={"nodes": 2})
    assert plan(trl, accelerator="gpu", run_module="trl.scripts.sft").node(1).command == \
        (*base, "-m", "trl.scripts.sft", "--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "/o")
    assert plan(trl, accelerator="gpu").node(1).command[-7] == "trl.scripts.sft"  # TRL not installed here: by name


def test_plan_fields_for_own_code_and_none_for_built_ins():
    p = plan(job({"script": "/src/train.py", "args": ["--data", "/d/x.jsonl", "--out=/o", "--n", "3"]}))
    assert (p.recipe, p.run_kind, p.run_target, p.run_paths) == ("script", "script", "/src/train.py",
                                                                 ("/src/train.py", "/d/x.jsonl", "/o"))
    assert LaunchPlan.from_json(p.to_json()) == p
    assert p.node(0).env["ORCHESTRATE_RESUME"] == "auto" and p.node(0).env["ORCHESTRATE_SAVE_ON_SIGNAL"] == "1"
    recipe = parse_recipe({"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/d.jsonl"}})
    built_in = plan(recipe)
    d = json.loads(built_in.to_json())
    assert not {"run_kind", "run_target", "run_paths"} & set(d)  # a built-in recipe's plan.json keeps its bytes
    assert LaunchPlan.from_json(built_in.to_json()).run_kind == "recipe"
    assert "ORCHESTRATE_RESUME" not in built_in.node(0).env


def test_effective_batch_and_tokens_from_what_the_args_carry():
    p = plan(job({"script": "/t.py", "args": {"per_device_train_batch_size": "4", "gradient_accumulation_steps": 2,
                                              "max_seq_length": 512}}, launch={"nodes": 2, "procs_per_node": 2}))
    assert (p.per_device_batch, p.grad_accum, p.effective_batch, p.tokens_per_step) == (4, 2, 32, 32 * 512)
    assert not p.tokens_per_step_exact
    p = plan(job({"script": "/t.py", "args": ["--gradient_accumulation_steps", "4"]}),
             trainer_defaults={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1})
    assert (p.per_device_batch, p.effective_batch, p.max_length, p.tokens_per_step) == (8, 32, None, None)
    p = plan(job({"script": "/t.py", "args": ["--lr", "1"]}))
    assert (p.per_device_batch, p.grad_accum, p.effective_batch) == (None, None, None)
    text = summary(p)
    assert "batch      set by your code" in text and "tokens     unknown per step" in text
    t = plan(job({"trl": "sft", "args": {**NEEDS, "packing": True}}, launch={"nodes": 2}), accelerator="gpu",
             trainer_defaults=DEFAULTS)
    assert (t.effective_batch, t.max_length, t.tokens_per_step, t.tokens_per_step_exact) == (16, 1024, 16 * 1024, True)
    assert "(own code: trl sft, job 'my_job'" in summary(t)


def test_what_the_plan_adds_to_a_trl_subcommand_and_never_to_a_script():
    on_cpu = plan(job({"trl": "sft", "args": {**NEEDS, "output_dir": "/o"}}), trainer_defaults=DEFAULTS)
    assert on_cpu.node(0).command[-6:] == ("--output_dir", "/o", "--bf16", "false", "--use_cpu", "true")
    assert "run.args: --bf16 false --use_cpu true added (a CPU cluster)" in on_cpu.warnings
    mine = plan(job({"trl": "sft", "args": {**NEEDS, "bf16": False, "use_cpu": True}}), trainer_defaults=DEFAULTS)
    assert mine.node(0).command[-4:] == ("--bf16", "false", "--use_cpu", "true") and not mine.warnings
    script = plan(job({"script": "/t.py"}), trainer_defaults=DEFAULTS)
    assert script.node(0).command[-1] == "/t.py" and not script.warnings
    cp = {"profile": "context_parallel", "nodes": 1, "procs_per_node": 4, "parallelism": {"cp": 2}}
    t = plan(job({"trl": "sft", "args": {**NEEDS, "attn_implementation": "sdpa"}}, launch=cp), accelerator="gpu",
             profile="context_parallel", trainer_defaults=DEFAULTS)
    assert t.node(0).command[-2:] == ("--pad_to_multiple_of", "4")
    assert any("--pad_to_multiple_of 4 added" in w for w in t.warnings)
    s = plan(job({"script": "/t.py"}, launch=cp), accelerator="gpu", profile="context_parallel")
    assert s.node(0).command[-1] == "/t.py"
    assert "sequence lengths must be a multiple of cp*2 = 4 (ring attention): make your code pad to it" in s.warnings


def test_parallelism_rules_read_the_args():
    cp = {"profile": "context_parallel", "nodes": 1, "procs_per_node": 4, "parallelism": {"cp": 2}}
    with pytest.raises(ConfigError) as e:
        plan(job({"script": "/t.py", "args": ["--max_length", "130", "--attn_implementation", "eager"]}, launch=cp),
             accelerator="gpu", profile="context_parallel")
    assert problems(e.value) == {"run.args[1]": "must be divisible by cp*2 = 4 (ring attention), got 130",
                                 "run.args[3]": "context parallelism (cp > 1) needs 'sdpa', got 'eager'"}
    with pytest.raises(ConfigError) as e:
        make_plan(job({"script": "/t.py"}, launch={"nodes": 3}),
                  parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a", "b"]}}), facts(hosts=("a", "b")))
    assert problems(e.value) == {"launch.nodes": "3 nodes asked but cluster 'ssh' lists only 2 host(s)"}


# ------------------------------------------------------------------------------ the installed TRL
@pytest.fixture(scope="module")
def trl_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("trl_cli_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHESTRATE_HOME", str(home))
        commands = trlfields.trl_commands()
        script_fields = trlfields.trainer_fields("script")
        grpo = trlfields.trainer_fields("trl:grpo")
    assert commands is not None, "trl is installed in the project venv"
    return home, commands, script_fields, grpo


def test_trl_subcommands_come_from_the_installed_trl(trl_home):
    import dataclasses

    import transformers
    import trl
    _, commands, script_fields, grpo = trl_home
    sft = commands["sft"]
    assert sft["module"] == "trl.scripts.sft" and sft["config"] == "SFTConfig" and sft["training"]
    assert {"--learning_rate", "--dataset_name", "--model_name_or_path"} <= set(sft["options"])
    assert commands["grpo"]["config"] == "GRPOConfig" and commands["dpo"]["training"]
    assert not commands["vllm-serve"]["training"] and not commands["env"]["training"]
    assert script_fields.keys() == {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert grpo.keys() == {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert trlfields.trainer_fields("trl:env") is None


def test_trl_cli_cache_needs_no_trl_import(trl_home):
    home = trl_home[0]
    code = ("import sys; from orchestrator.trlfields import trl_commands, trainer_fields, trainer_defaults; "
            "c = trl_commands(); f = trainer_fields('trl:grpo'); d = trainer_defaults('script'); "
            "print(c['sft']['module'], len(f) > 50, d['per_device_train_batch_size'], 'trl' in sys.modules, "
            "'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "ORCHESTRATE_HOME": str(home)})
    assert out.stdout.split() == ["trl.scripts.sft", "True", "8", "False", "False"], out.stderr


def test_run_args_checked_against_the_installed_trl(trl_home, monkeypatch):
    monkeypatch.setenv("ORCHESTRATE_HOME", str(trl_home[0]))
    spec = parse_job({"run": {"trl": "grpo", "args": {**NEEDS, "reward_funcs": "accuracy", "beta": "0.1"}}},
                     trainer_fields=trlfields.trainer_fields, trl_commands=trlfields.trl_commands)
    assert spec.run.trl == "grpo"
    with pytest.raises(ConfigError) as e:
        parse_job({"run": {"trl": "grpo", "args": {**NEEDS, "reward_funcs": "accuracy", "beta": "high",
                                                   "num_generation": 4}}},
                  trainer_fields=trlfields.trainer_fields, trl_commands=trlfields.trl_commands)
    p = problems(e.value)
    assert p["run.args.beta"] == "must be a number, got 'high'"
    assert p["run.args.num_generation"].startswith("not an option of trl grpo (did you mean 'num_generations'?)")


def test_example_jobs_plan(tmp_path, monkeypatch):
    """The shipped examples/own_code jobs are valid (the model directory is passed as an override)."""
    monkeypatch.chdir(REPO)
    for name in ("my_job", "trl_sft"):
        prep = api.prepare(f"examples/own_code/{name}.yaml", nodes=2, job_id="j", run_dir=str(tmp_path / name),
                           overrides=[f"run.args.model_name_or_path={tmp_path}"])
        assert prep.plan.nodes == 2 and prep.plan.effective_batch == 8 and prep.plan.max_length == 128
        assert prep.plan.output_dir == str(REPO / "outputs" / name)

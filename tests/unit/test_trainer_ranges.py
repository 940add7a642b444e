"""Values the trainer would refuse are refused at plan time (issue #28 item 8): the one table of ranges
(orchestrator.core.trainerranges.RANGES) holds for a built-in recipe's `trainer:` block and for own code's `run.args`
alike; the real CLI refuses `trainer.warmup_steps=-5` and `trainer.num_train_epochs=-1` with exit 2, the key named
and nothing started; every value at the edge of a range is taken or refused as the rule says, through every path
(recipe, recipe without TRL installed, own code), and where a torch / transformers / TRL / datasets component
enforces the range, the plan refuses exactly what that component refuses (no false refusal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from orchestrator import trlfields
from orchestrator.core.spec import TRL_NEEDS, parse_job, parse_recipe
from orchestrator.core.trainerranges import RANGES, RECIPE_CONFIGS, Rule, broken_rule
from orchestrator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "orchestrator.cli"]
BASE = {"model": {"name_or_path": "tiny-llama", "attn_implementation": "sdpa"}, "data": {"path": "/data/x.jsonl"}}
# where a config class's fields reach the plan: a built-in recipe's trainer: block, or own code's run.args
RECIPE_OF = {"SFTConfig": "sft", "DPOConfig": "dpo"}
RUN_OF = {"TrainingArguments": "script", "SFTConfig": "trl:sft", "DPOConfig": "trl:dpo", "GRPOConfig": "trl:grpo",
          "RLOOConfig": "trl:rloo", "KTOConfig": "trl:kto", "RewardConfig": "trl:reward",
          "DistillationConfig": "trl:distillation"}
# a setting that turns a field's conditional rules off (to check its other rules alone); DPO's loss_type is a list
OFF = {"logging_strategy": "epoch", "dataloader_num_workers": 2, "loss_type": ["sigmoid"], "sync_ref_model": False}


def problems(exc: ConfigError) -> dict[str, str]:
    return {p.where: p.message for p in exc.problems}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The installed transformers / TRL: {fields key: {field: kind}}, {class: fields key}, the TRL subcommands."""
    home = tmp_path_factory.mktemp("ranges_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHESTRATE_HOME", str(home))
        commands = trlfields.trl_commands()
        kinds = {key: trlfields.trainer_fields(key) for key in {*RECIPE_OF.values(), *RUN_OF.values()}}
    assert commands is not None and all(kinds.values()), "transformers and trl are installed in the project venv"
    return kinds, commands


def paths(field: str, installed) -> list[tuple[str, str]]:
    """Where `field` reaches the plan: (recipe | recipe-no-trl | run, fields key). A recipe whose config has it, the
    same recipe where TRL is not installed (kinds unknown: every rule that is not `only` for a class applies), and
    one own-code run whose config has it (a script where TrainingArguments has it, else a TRL subcommand)."""
    kinds, _ = installed
    only = {c for r in RANGES[field] for c in r.only}
    out = [("recipe", key) for cls, key in RECIPE_OF.items() if field in kinds[key] and (not only or cls in only)][:1]
    if not only:
        out.append(("recipe-no-trl", "sft"))
    out += [("run", key) for cls, key in RUN_OF.items() if field in kinds[key] and (not only or cls in only)][:1]
    return out


def needs(commands: dict, subcommand: str) -> dict[str, str]:
    """What a job of `subcommand` cannot run without (core.spec.TRL_NEEDS), given, so that only the field checked
    is wrong."""
    accepted = {o[2:] for o in commands[subcommand]["options"] or ()}
    return {names[0]: "x" for _, names in TRL_NEEDS if names[0] in accepted}


def verdict(path: tuple[str, str], field: str, value: Any, context: dict[str, Any], installed) -> dict[str, str]:
    """The problems the plan names for `{**context, field: value}` on `path` ({} when it is taken)."""
    kinds, commands = installed
    how, key = path
    values = {**context, field: value}
    try:
        if how == "run":
            run = {"script": "train.py"} if key == "script" else {"trl": key[4:]}
            given = needs(commands, key[4:]) if key != "script" else {}
            parse_job({"run": {**run, "args": {**given, **values}}}, trainer_fields=kinds.get,
                      trl_commands=lambda: commands)
        else:
            parse_recipe({**BASE, "recipe": key, "trainer": values},
                         trainer_fields=kinds.get if how == "recipe" else None)
    except ConfigError as e:
        return problems(e)
    return {}


def where(path: tuple[str, str], field: str) -> str:
    return f"run.args.{field}" if path[0] == "run" else f"trainer.{field}"


def edges(rule: Rule) -> tuple[list[Any], list[Any]]:
    """(values a rule takes at its bounds, values just outside them)."""
    if rule.unset:
        return [None], [2]
    if rule.ratio:
        inside: list[Any] = [1e-6, 0.5, 0.999, 1, 7]
        outside: list[Any] = [-1, 2.5]
        (outside if rule.lo_open else inside).append(0)
    else:
        step = 1 if rule.integer else 0.01
        inside, outside = [], []
        for bound, is_open, sign in ((rule.lo, rule.lo_open, 1), (rule.hi, rule.hi_open, -1)):
            if bound is not None:
                (outside if is_open else inside).append(bound)
                inside.append(round(bound + sign * step, 6))
                outside.append(round(bound - sign * step, 6))
    inside += [*rule.also, *([None] if rule.null else [])]
    return inside, [v for v in outside if v not in rule.also]


def rule_cases() -> list[tuple[str, int]]:
    return [(field, i) for field, rules in RANGES.items() for i in range(len(rules))]


# ------------------------------------------------------------------------------ the real CLI
@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One ORCHESTRATE_HOME for the CLI runs (its field caches are built once)."""
    return tmp_path_factory.mktemp("cli_home")


def recorded(home: Path) -> list[Path]:
    """What a job leaves in the store: its run dir, the job database."""
    return sorted(p.relative_to(home) for p in home.rglob("*") if "runs" in p.parts or p.name.startswith("jobs.db"))


def _cli(argv: list[str], home: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*CLI, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("override,line", [
    ("trainer.warmup_steps=-5", "trainer.warmup_steps: must be an integer >= 0 or a ratio in [0, 1), got -5"),
    ("trainer.num_train_epochs=-1", "trainer.num_train_epochs: must be a number >= 0, got -1"),
])
@pytest.mark.parametrize("command", ["render", "submit"])
def test_cli_refuses_what_the_trainer_would_refuse_before_anything_starts(tmp_path, home, command, override, line):
    """`render` and a real local `submit`: exit 2, one line naming the key, nothing written, recorded or started."""
    out, outputs = tmp_path / "out", REPO / "outputs" / "sft_tiny"
    had_outputs, before = outputs.exists(), recorded(home)
    argv = ["render", "recipes/configs/sft_tiny.yaml", "--out", str(out)] if command == "render" else \
        ["submit", "recipes/configs/sft_tiny.yaml"]
    r = _cli([*argv, override], home)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [f"orchestrate: error: recipes/configs/sft_tiny.yaml: {line}"]
    assert not out.exists() and recorded(home) == before
    assert outputs.exists() == had_outputs


def test_cli_takes_the_edges_of_the_ranges(tmp_path, home):
    """Values at the edges pass the plan and reach the resolved recipe as given."""
    given = {"warmup_steps": 0, "num_train_epochs": 0, "learning_rate": 0, "seed": 4294967295, "adam_beta1": 0,
             "adam_beta2": 0.999, "weight_decay": 0, "logging_steps": 0.5, "save_steps": 0, "max_steps": -1,
             "pad_to_multiple_of": "auto", "dataloader_prefetch_factor": None, "torch_empty_cache_steps": 1}
    r = _cli(["render", "recipes/configs/sft_tiny.yaml", "--out", str(tmp_path / "out"),
              *(f"trainer.{k}={'null' if v is None else v}" for k, v in given.items())], home)
    assert r.returncode == 0, r.stderr
    trainer = yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())["trainer"]
    assert {k: trainer[k] for k in given} == given


def test_cli_refuses_own_code_args_in_both_forms(tmp_path, home):
    """Own code: a mapping's option, a list's word and a `run.args.X=` override, each named, all together."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "map.yaml").write_text("run: {trl: sft, args: {num_train_epochs: -1, seed: 7, model_name_or_path: m, "
                                       "dataset_name: d}}\n")
    (tmp_path / "words.yaml").write_text("run: {script: train.py, args: [--warmup_steps, '-5', --seed, '7']}\n")
    r = _cli(["render", "map.yaml", "--out", str(tmp_path / "o1")], home, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "orchestrate: error: map.yaml: run.args.num_train_epochs: must be a number >= 0, got -1"], r.stderr
    r = _cli(["render", "words.yaml", "--out", str(tmp_path / "o2"), "run.args.adam_beta1=1"], home, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "orchestrate: error: words.yaml: 2 problems: run.args[1]: must be an integer >= 0 or a ratio in [0, 1), "
        "got -5; run.args[5]: must be a number in [0, 1), got 1"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.yaml", "train.py", "words.yaml"]  # no o1/, o2/


# ------------------------------------------------------------------------------ every rule, every path
@pytest.mark.parametrize("field,index", rule_cases(), ids=[f"{f}-{i}" for f, i in rule_cases()])
def test_every_rule_takes_its_edges_and_refuses_beyond_them_on_every_path(installed, field, index):
    rule = RANGES[field][index]
    if rule.when:
        name, want, _ = rule.when
        context = {name: [want] if isinstance(OFF[name], list) else want}
    else:
        context = {r.when[0]: OFF[r.when[0]] for r in RANGES[field] if r.when}
    inside, outside = edges(rule)
    assert inside and outside
    for path in paths(field, installed):
        for value in inside:
            if value is None and path[0] == "run":
                continue  # a command line has no null
            assert verdict(path, field, value, context, installed) == {}, (path, value)
        for value in outside:
            if value is None and path[0] == "run":
                continue
            got = verdict(path, field, value, context, installed)
            assert list(got) == [where(path, field)] and got[where(path, field)].startswith("must be "), (path, value)


@pytest.mark.parametrize("value,message", [
    (-5, "must be an integer >= 0 or a ratio in [0, 1), got -5"),
    (2.5, "must be an integer >= 0 or a ratio in [0, 1), got 2.5"),
])
def test_warmup_steps_messages(installed, value, message):
    for path in paths("warmup_steps", installed):
        assert verdict(path, "warmup_steps", value, {}, installed) == {where(path, "warmup_steps"): message}


@pytest.mark.parametrize("recipe,trainer,expected", [
    ("sft", {"num_train_epochs": -1}, {"trainer.num_train_epochs": "must be a number >= 0, got -1"}),
    ("sft", {"seed": -1}, {"trainer.seed": "must be an integer in [0, 4294967295], got -1"}),
    ("sft", {"adam_beta2": 1.0}, {"trainer.adam_beta2": "must be a number in [0, 1), got 1.0"}),
    ("sft", {"learning_rate": "-1e-4"}, {"trainer.learning_rate": "must be a number >= 0, got -0.0001"}),
    ("sft", {"logging_steps": 0}, {"trainer.logging_steps": "must be an integer >= 1 or a ratio in (0, 1) when "
                                                             "logging_strategy is steps, got 0"}),
    ("sft", {"dataloader_prefetch_factor": 2}, {"trainer.dataloader_prefetch_factor": "must be null (unset) when "
                                                "dataloader_num_workers is 0, got 2"}),
    ("sft", {"max_length": 0, "per_device_train_batch_size": 0, "weight_decay": -0.1},
     {"trainer.max_length": "must be an integer >= 1, got 0",
      "trainer.per_device_train_batch_size": "must be an integer >= 1, got 0",
      "trainer.weight_decay": "must be a number >= 0, got -0.1"}),
    ("dpo", {"loss_type": ["sigmoid", "exo_pair"], "label_smoothing": 0},
     {"trainer.label_smoothing": "must be a number > 0 when loss_type is exo_pair, got 0"}),
    ("dpo", {"sync_ref_model": True, "ref_model_sync_steps": 0},
     {"trainer.ref_model_sync_steps": "must be an integer >= 1 when sync_ref_model is true, got 0"}),
    ("dpo", {"ld_alpha": 1.5}, {"trainer.ld_alpha": "must be a number in [0, 1], got 1.5"}),
])
def test_recipe_values_refused_with_the_key_named(installed, recipe, trainer, expected):
    with pytest.raises(ConfigError) as e:
        parse_recipe({**BASE, "recipe": recipe, "trainer": trainer}, trainer_fields=installed[0].get)
    assert problems(e.value) == expected and e.value.exit_code == 2


def test_rules_that_hold_only_where_they_apply(installed):
    kinds, commands = installed

    def run_problems(run: dict, fields=kinds.get, table=lambda: commands) -> dict[str, str]:
        if "trl" in run and table() is not None:
            run = {**run, "args": {**needs(table(), run["trl"]), **run["args"]}}
        try:
            parse_job({"run": run}, trainer_fields=fields, trl_commands=table)
        except ConfigError as e:
            return problems(e)
        return {}
    # beta: DistillationConfig refuses outside [0, 1]; DPO's beta has no range
    assert run_problems({"trl": "distillation", "args": {"beta": 1.5}}) == {
        "run.args.beta": "must be a number in [0, 1], got 1.5"}
    assert run_problems({"trl": "dpo", "args": {"beta": 1.5}}) == {}
    assert verdict(("recipe", "dpo"), "beta", -1, {}, installed) == {}
    # the conditional rules read the other settings as given, in either form of the args
    assert run_problems({"script": "t.py", "args": ["--logging_strategy", "epoch", "--logging_steps", "0"]}) == {}
    assert run_problems({"script": "t.py", "args": ["--logging_steps", "0"]}) == {
        "run.args[1]": "must be an integer >= 1 or a ratio in (0, 1) when logging_strategy is steps, got 0"}
    assert run_problems({"script": "t.py", "args": {"dataloader_num_workers": "2", "dataloader_prefetch_factor": 4}}) \
        == {}
    # a script's own option that is no TrainingArguments field is its own business ...
    assert run_problems({"script": "t.py", "args": {"temperature": -1, "num_generations": 1}}) == {}
    # ... but the ones the plan reads are checked wherever given, even where the fields are not known
    unknown = run_problems({"script": "t.py", "args": {"learning_rate": -1, "seed": -1, "max_steps": 0}},
                           fields=lambda key: None, table=lambda: None)
    assert unknown == {"run.args.learning_rate": "must be a number >= 0, got -1",
                       "run.args.max_steps": "must be -1 (no limit) or an integer >= 1, got 0"}
    assert run_problems({"trl": "grpo", "args": {"num_generations": 1, "temperature": 0, "top_p": 0}}) == {
        "run.args.num_generations": "must be an integer >= 2, got 1",
        "run.args.temperature": "must be a number > 0, got 0",
        "run.args.top_p": "must be a number in (0, 1], got 0"}


# ------------------------------------------------------------------------------ the table itself
def test_every_ranged_field_is_a_numeric_field_of_an_installed_config(installed):
    """A typo in the table would check nothing: every field is a field of some installed config class (or of
    transformers 4's TrainingArguments: warmup_ratio), of a numeric kind; `when` names a field; `only` a class."""
    kinds, commands = installed
    every: dict[str, str] = {}
    for key in kinds:
        every.update(kinds[key])
    classes = {e["config"] for e in commands.values() if e.get("config")} | {"TrainingArguments"}
    assert set(RECIPE_CONFIGS.values()) <= classes
    for field, rules in RANGES.items():
        if field == "warmup_ratio" and field not in every:
            continue  # transformers < 5
        assert field in every, field
        assert every[field].replace("opt_", "") in ("int", "float", "any"), (field, every[field])
        for rule in rules:
            assert rule.why and (rule.when is None or rule.when[0] in every) and set(rule.only) <= classes, field


# ------------------------------------------------------------------------------ the trainer agrees
def _targs(**kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir="/nonexistent/ranges", use_cpu=True, report_to="none", **kw)


def _trl(cls_name: str, **kw):
    import trl
    return getattr(trl, cls_name)(output_dir="/nonexistent/ranges", use_cpu=True, report_to="none", bf16=False, **kw)


def _adamw(**kw):
    """torch's AdamW as the Trainer builds it: the values are floats (HfArgumentParser, recipes.common.as_parsed)."""
    import torch
    kw = {k: tuple(map(float, v)) if isinstance(v, tuple) else float(v) for k, v in kw.items()}
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **kw)


def _loader(**kw):
    from torch.utils.data import DataLoader
    DataLoader(list(range(4)), **kw)


def _neftune(v):
    import torch
    from transformers.integrations.neftune import neftune_post_forward_hook
    if v is not None:  # the Trainer hooks NEFTune in only when it is set
        module = torch.nn.Embedding(4, 2)
        module.neftune_noise_alpha = v
        neftune_post_forward_hook(module, None, torch.zeros(1, 2, 2))


def _seed(v):
    from transformers import set_seed
    set_seed(v)


def _logits(name: str, v):
    from transformers.generation import logits_process
    if v is not None:
        getattr(logits_process, name)(float(v))


def _generation(v):
    from transformers import GenerationConfig
    GenerationConfig(max_new_tokens=v)


def _dataset_map(v):
    from datasets import Dataset
    Dataset.from_dict({"a": [1, 2]}).map(lambda x: x, num_proc=v)


# (field, the other settings, what the trainer does with the value, values only the documentation rules out)
PROBES: list[tuple[str, dict[str, Any], Callable[[Any], Any], tuple[Any, ...]]] = [
    ("warmup_steps", {}, lambda v: _targs(warmup_steps=v), (2.5,)),  # documented: an integer or a ratio in [0, 1)
    ("logging_steps", {}, lambda v: _targs(logging_steps=v), (-1,)),  # documented: >= 0
    ("save_steps", {}, lambda v: _targs(save_steps=v), (-1,)),
    ("eval_steps", {"eval_strategy": "steps"}, lambda v: _targs(eval_strategy="steps", eval_steps=v), (-1,)),
    ("torch_empty_cache_steps", {}, lambda v: _targs(torch_empty_cache_steps=v), ()),
    ("dataloader_prefetch_factor", {}, lambda v: _targs(dataloader_prefetch_factor=v), ()),
    ("dataloader_prefetch_factor", {"dataloader_num_workers": 2},
     lambda v: _loader(num_workers=2, prefetch_factor=v), ()),
    ("dataloader_num_workers", {}, lambda v: _loader(num_workers=v), ()),
    ("per_device_train_batch_size", {}, lambda v: _loader(batch_size=v), ()),
    ("per_device_eval_batch_size", {}, lambda v: _loader(batch_size=v), ()),
    ("precompute_ref_batch_size", {}, lambda v: _loader(batch_size=v or 8), ()),  # DPOTrainer: `or` the batch size
    ("learning_rate", {}, lambda v: _adamw(lr=v), ()),
    ("weight_decay", {}, lambda v: _adamw(weight_decay=v), ()),
    ("adam_beta1", {}, lambda v: _adamw(betas=(v, 0.999)), ()),
    ("adam_beta2", {}, lambda v: _adamw(betas=(0.9, v)), ()),
    ("adam_epsilon", {}, lambda v: _adamw(eps=v), ()),
    ("seed", {}, _seed, ()),
    ("neftune_noise_alpha", {}, _neftune, ()),
    ("num_generations", {"per_device_train_batch_size": 6},
     lambda v: _trl("GRPOConfig", num_generations=v, per_device_train_batch_size=6), ()),
    ("beta", {}, lambda v: _trl("DistillationConfig", beta=v), ()),
    ("temperature", {}, lambda v: _logits("TemperatureLogitsWarper", v), ()),
    ("top_p", {}, lambda v: _logits("TopPLogitsWarper", v), (0,)),  # documented (GRPOConfig): (0, 1]
    ("min_p", {}, lambda v: _logits("MinPLogitsWarper", v), ()),
    ("repetition_penalty", {}, lambda v: _logits("RepetitionPenaltyLogitsProcessor", v), ()),
    ("max_completion_length", {}, _generation, ()),
    ("dataset_num_proc", {}, _dataset_map, ()),
]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own default
@pytest.mark.parametrize("field,context,probe,documented", PROBES, ids=[p[0] for p in PROBES])
def test_the_plan_refuses_exactly_what_the_trainer_refuses(installed, field, context, probe, documented):
    """At every edge of the field's rules: the component that enforces the range (TrainingArguments, a TRL config,
    torch's optimizer / DataLoader, numpy's seed, transformers' logits processors, datasets' map) takes the value
    if and only if the plan does, except for the values only the trainer's documentation rules out."""
    values = sorted({v for rule in RANGES[field] for side in edges(rule) for v in side if v is not None}) + \
        ([None] if any(r.null or r.unset for r in RANGES[field]) else [])
    for value in values:
        try:
            probe(value)
            trainer_takes = True
        except (ValueError, TypeError, RuntimeError):
            trainer_takes = False
        for path in paths(field, installed):
            if value is None and path[0] == "run":
                continue
            plan_takes = verdict(path, field, value, context, installed) == {}
            if value in documented:
                assert trainer_takes and not plan_takes, (field, value, path)
            else:
                assert plan_takes == trainer_takes, (field, value, path, trainer_takes)


def test_broken_rule_is_the_first_one_that_holds():
    assert broken_rule("logging_steps", 0, {"logging_strategy": "epoch"}, "SFTConfig") is None
    assert broken_rule("logging_steps", 0, {}, "SFTConfig") is RANGES["logging_steps"][1]
    assert broken_rule("logging_steps", -1, {}, "SFTConfig") is RANGES["logging_steps"][0]
    assert broken_rule("beta", 7, {}, "DPOConfig") is None and broken_rule("beta", 7, {}, None) is None
    assert broken_rule("my_own_option", -1, {}, None) is None


def test_a_recipe_passes_integers_of_float_fields_as_floats(tmp_path):
    """`trainer.adam_beta1: 0` is in range; the recipe hands it to the config as 0.0, as a command line would be read,
    so torch's AdamW takes it (an int beta it refuses: "betas must be either both floats or both Tensors")."""
    import torch
    import trl

    from recipes.common import Runtime, build_config
    cfg = {"recipe": "sft", "model": {"name_or_path": "tiny-llama", "dtype": "float32"},
           "trainer": {"adam_beta1": 0, "warmup_steps": 2, "max_steps": 3, "output_dir": str(tmp_path)}}
    c = build_config(trl.SFTConfig, cfg, Runtime(accelerator="cpu", engine="ddp", world_size=1, rank=0,
                                                 pg_timeout_s=60))
    assert (c.adam_beta1, c.warmup_steps, c.max_steps) == (0.0, 2.0, 3) and type(c.adam_beta1) is float
    assert type(c.max_steps) is int
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(c.adam_beta1, c.adam_beta2))
    with pytest.raises(ValueError, match="betas must be either both floats"):
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0, c.adam_beta2))

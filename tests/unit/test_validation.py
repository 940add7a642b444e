"""Trainer values checked against TRL's own field types and the plan's ranges, host names refused on the
command line, and the cp/sp `pad_to_multiple_of` the plan fills in (and writes to the resolved recipe)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from orchestrator import trlfields
from orchestrator.core.plan import PlanFacts, apply_plan_defaults, make_plan
from orchestrator.core.render import render_files, summary
from orchestrator.core.spec import load, parse_cluster, parse_recipe
from orchestrator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "orchestrator.cli"]
BASE = {"recipe": "sft", "model": {"name_or_path": "tiny-llama", "attn_implementation": "sdpa"},
        "data": {"path": "/data/x.jsonl"}, "trainer": {"max_length": 512}}


def problems(exc: ConfigError) -> dict[str, str]:
    return {p.where: p.message for p in exc.problems}


@pytest.fixture(scope="module")
def trl_home(tmp_path_factory):
    """A fresh ORCHESTRATE_HOME whose TRL field cache is built from the installed trl."""
    home = tmp_path_factory.mktemp("trl_home") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHESTRATE_HOME", str(home))
        sft, dpo = trlfields.trainer_fields("sft"), trlfields.trainer_fields("dpo")
    assert sft is not None and dpo is not None, "trl is installed in the project venv"
    return home, {"sft": sft, "cp": sft, "dpo": dpo}


# ------------------------------------------------------------------------------ TRL's field kinds
def test_kinds_come_from_trl_field_types(trl_home):
    _, kinds = trl_home
    import trl
    sft = kinds["sft"]
    assert sft.keys() == {f.name for f in dataclasses.fields(trl.SFTConfig)}
    assert sft["learning_rate"] == "float" and sft["per_device_train_batch_size"] == "int"
    assert sft["gradient_accumulation_steps"] == "int" and sft["max_steps"] == "int"
    assert sft["max_length"] == "opt_int" and sft["packing"] == "bool" and sft["output_dir"] == "opt_str"
    assert sft["lr_scheduler_type"] == "str"  # SchedulerType | str: a str enum
    assert sft["report_to"] == "any" and sft["model_init_kwargs"] == "any"  # unions of several types
    assert kinds["dpo"]["beta"] == "float" and "beta" not in sft
    assert set(sft.values()) <= {k for base in trlfields.KINDS for k in (base, "opt_" + base)}


def test_cache_is_private_and_planning_needs_no_trl(trl_home):
    home, kinds = trl_home
    path = trlfields.cache_path(home, version("trl"), "sft")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text())["fields"] == kinds["sft"]
    code = ("import sys; from orchestrator.trlfields import trainer_fields; f = trainer_fields('sft'); "
            "print(len(f), 'trl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "ORCHESTRATE_HOME": str(home)})
    assert out.stdout.split() == [str(len(kinds["sft"])), "False"], out.stderr


def test_a_stale_or_broken_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path))
    path = trlfields.cache_path(tmp_path, version("trl"), "dpo")
    path.parent.mkdir(parents=True)
    for stale in ('["beta", "learning_rate"]', "{not json", '{"format": 1, "fields": {"beta": 3}}'):
        path.write_text(stale)
        assert trlfields.trainer_fields("dpo")["beta"] == "float"
        assert json.loads(path.read_text())["fields"]["beta"] == "float"


def test_kind_of_simple_types():
    from typing import Any, Literal, Optional, Union
    k = trlfields.kind_of
    assert [k(int), k(float), k(bool), k(str), k(list[int]), k(dict[str, Any]), k(tuple[int, ...])] == \
        ["int", "float", "bool", "str", "list", "dict", "list"]
    assert k(Optional[int]) == "opt_int" and k(Union[int, str]) == "any" and k(Union[str, None, Literal[False]]) == \
        "any" and k(Any) == "any" and k("int") == "any" and k(Literal["a", "b"]) == "str"


@pytest.mark.parametrize("key,value,message", [
    ("learning_rate", "fast", "must be a number, got 'fast'"),
    ("learning_rate", -0.001, "must be a number >= 0, got -0.001"),
    ("per_device_train_batch_size", 0, "must be an integer >= 1, got 0"),
    ("gradient_accumulation_steps", -1, "must be an integer >= 1, got -1"),
    ("max_length", -3, "must be an integer >= 1, got -3"),
    ("max_steps", 0, "must be -1 (no limit) or an integer >= 1, got 0"),
    ("pad_to_multiple_of", 0, "must be an integer >= 1 or auto, got 0"),
    ("packing", "yes", "must be true or false, got 'yes'"),
    ("seed", 1.5, "must be an integer, got 1.5"),
    ("warmup_steps", "some", "must be a number, got 'some'"),
    ("lr_scheduler_type", 3, "must be a string, got 3"),
    ("logging_steps", None, "must not be null"),
])
def test_bad_trainer_values_named(trl_home, key, value, message):
    _, kinds = trl_home
    d = copy.deepcopy(BASE)
    d["trainer"][key] = value
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, trainer_fields=kinds.get)
    assert problems(e.value) == {f"trainer.{key}": message}


def test_good_trainer_values_pass_and_numbers_in_strings_become_floats(trl_home):
    _, kinds = trl_home
    d = copy.deepcopy(BASE)
    d["trainer"].update(learning_rate="1e-4", warmup_steps=2, max_length=None, pad_to_multiple_of=None, max_steps=-1,
                        report_to="none", bf16=None, model_init_kwargs={"dtype": "float32"}, lr_scheduler_type="cosine")
    r = parse_recipe(d, trainer_fields=kinds.get)
    assert r.trainer["learning_rate"] == 1e-4 and r.trainer["warmup_steps"] == 2 and r.trainer["max_length"] is None
    dpo = dict(copy.deepcopy(BASE), recipe="dpo", trainer={"beta": "0.1", "max_length": 256})
    assert parse_recipe(dpo, trainer_fields=kinds.get).trainer["beta"] == 0.1
    with pytest.raises(ConfigError, match="trainer.beta: unknown sft trainer option"):
        parse_recipe(dict(dpo, recipe="sft"), trainer_fields=kinds.get)


def test_all_trainer_problems_reported_together_with_the_rest(trl_home):
    _, kinds = trl_home
    d = copy.deepcopy(BASE)
    d["trainer"].update(learning_rate="fast", per_device_train_batch_size=0, packing="yes", learning_rat=1)
    d["launch"] = {"nodes": 0}
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, source="r.yaml", trainer_fields=kinds.get)
    assert set(problems(e.value)) == {"launch.nodes", "trainer.learning_rate", "trainer.per_device_train_batch_size",
                                      "trainer.packing", "trainer.learning_rat"}
    assert str(e.value).startswith("r.yaml: 5 problems: ")


def test_every_shipped_recipe_passes_trl_kinds(trl_home, monkeypatch):
    monkeypatch.setenv("ORCHESTRATE_HOME", str(trl_home[0]))
    for path in sorted((REPO / "recipes" / "configs").glob("*.yaml")):
        load(str(path), trainer_fields=trlfields.trainer_fields)


# ------------------------------------------------------------------------------ the command line
def _render(tmp_path, *args):
    out = tmp_path / "out"
    r = subprocess.run([*CLI, "render", "recipes/configs/sft_tiny.yaml", "--out", str(out), *map(str, args)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    return r, out


@pytest.mark.parametrize("override,key", [
    ("trainer.learning_rate=fast", "trainer.learning_rate"),
    ("trainer.per_device_train_batch_size=0", "trainer.per_device_train_batch_size"),
    ("trainer.gradient_accumulation_steps=-1", "trainer.gradient_accumulation_steps"),
    ("trainer.max_length=-3", "trainer.max_length"),
])
def test_render_refuses_bad_trainer_values(tmp_path, override, key):
    r, out = _render(tmp_path, override)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{key}: must be" in lines[0], r.stderr
    assert not out.exists()


def test_render_refuses_a_host_with_a_shell_command(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text('kind: ssh\nssh:\n  hosts: ["127.0.0.2;rm -rf /", 127.0.0.3]\n')
    r, out = _render(tmp_path, "--cluster", cluster)
    assert r.returncode == 2, r.stderr
    assert "ssh.hosts[0]: '127.0.0.2;rm -rf /' is not a valid host name or IP address" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


# ------------------------------------------------------------------------------ cp/sp pad_to_multiple_of
PROFILES = {"fsdp2": {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}},
            "zero3": {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}}


def _facts(profile):
    return PlanFacts(job_id="j", run_dir="/runs/j", output_dir="/out", python="python", port=29500,
                     accelerator="gpu", profile_name=profile, profile_config=PROFILES[profile],
                     model_facts={"num_attention_heads": 4, "num_key_value_heads": 2})


def _recipe(par, **trainer):
    d = copy.deepcopy(BASE)
    d["trainer"].update(trainer)
    d["launch"] = {"procs_per_node": 4, "parallelism": par, "profile": "fsdp2" if "cp" in par else "zero3"}
    return parse_recipe(d, source="r.yaml")


@pytest.mark.parametrize("par,profile,multiple", [({"cp": 2}, "fsdp2", 4), ({"sp": 4}, "zero3", 4),
                                                  ({"sp": 2}, "zero3", 2)])
def test_unset_pad_to_multiple_of_is_filled_in_and_said(par, profile, multiple):
    r = _recipe(par)
    filled, notes = apply_plan_defaults(r)
    assert filled.trainer["pad_to_multiple_of"] == multiple and "pad_to_multiple_of" not in r.trainer
    assert len(notes) == 1 and notes[0].startswith(f"trainer.pad_to_multiple_of set to {multiple}")
    assert filled.to_dict()["trainer"]["pad_to_multiple_of"] == multiple  # what RUN_DIR/recipe.yaml carries
    assert apply_plan_defaults(filled) == (filled, ())  # idempotent
    plan = make_plan(filled, parse_cluster({}), _facts(profile), notes=notes)
    assert plan.warnings[0] == notes[0] and f"warning: {notes[0]}" in summary(plan)
    assert f"pad_to_multiple_of: {multiple}" in render_files(plan, filled.to_dict())["recipe.yaml"]
    # a caller that planned without applying it first gets the same plan and note
    assert make_plan(r, parse_cluster({}), _facts(profile)).warnings == plan.warnings


def test_set_pad_to_multiple_of_is_kept_or_refused():
    ok = _recipe({"cp": 2}, pad_to_multiple_of=8)
    assert apply_plan_defaults(ok) == (ok, ())
    assert make_plan(ok, parse_cluster({}), _facts("fsdp2")).warnings == ()
    with pytest.raises(ConfigError) as e:
        make_plan(_recipe({"cp": 2}, pad_to_multiple_of=6), parse_cluster({}), _facts("fsdp2"))
    assert problems(e.value) == {"trainer.pad_to_multiple_of": "must be divisible by cp*2 = 4 (ring attention), got 6"}
    plain = parse_recipe(BASE)
    assert apply_plan_defaults(plain) == (plain, ())


def test_trl_config_cache_is_named_by_the_transformers_version_too(tmp_path, monkeypatch):
    """TRL's configs inherit transformers' TrainingArguments: after a transformers upgrade (same TRL) the fields are
    read again, not taken from the old cache (seen on a GPU machine: a field new in transformers was refused)."""
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path))
    real = trlfields._version

    def fake(package):
        return "0.0.1-old" if package == "transformers" else real(package)

    old_path = trlfields._path(tmp_path, "trl", f"{version('trl')}+transformers-0.0.1-old", "SFTConfig")
    old_path.parent.mkdir(parents=True)
    old_path.write_text(json.dumps({"format": trlfields.CACHE_FORMAT, "fields": {"only_this": "int"},
                                    "defaults": {}}))
    monkeypatch.setattr(trlfields, "_version", fake)
    assert trlfields.trainer_fields("sft") == {"only_this": "int"}  # the cache of that transformers version
    monkeypatch.setattr(trlfields, "_version", real)
    fields = trlfields.trainer_fields("sft")  # the installed transformers: its own cache, built now
    assert "only_this" not in fields and "learning_rate" in fields
    assert trlfields.cache_path(tmp_path, version("trl"), "sft").name == \
        f"trl-{version('trl')}+transformers-{version('transformers')}-SFTConfig.kinds.json"

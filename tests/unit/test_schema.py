"""The validator is derived from the spec dataclasses (one source of fields, defaults and checks), and host
names are checked before anything could use them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.health import HealthSpec
from orchestrator.core.schema import build, expand_hosts, is_host, rules
from orchestrator.core.spec import (ClusterSpec, LaunchSpec, RecipeSpec, SSHSpec, SlurmSpec, cluster_from_dict,
                                    cluster_to_dict, load, parse_cluster, parse_hostfile, parse_recipe)
from orchestrator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
MINIMAL = {"recipe": "sft", "model": {"name_or_path": "tiny-llama"}, "data": {"path": "/d.jsonl"}}


def problems(exc: ConfigError) -> dict[str, str]:
    return {p.where: p.message for p in exc.problems}


# ------------------------------------------------------------------------------ one source
def test_defaults_are_the_dataclass_defaults():
    r = parse_recipe(MINIMAL, source="r.yaml")
    assert r.launch == LaunchSpec() and r.health == HealthSpec() and r.tokenizer is None and r.trainer == {}
    assert r.data.path == ("/d.jsonl",) and r.source == "r.yaml"
    s = parse_cluster({"kind": "slurm"})
    assert s.slurm == SlurmSpec() and s.ssh is None
    c = parse_cluster({"kind": "ssh", "ssh": {"hosts": ["a"]}})
    assert dataclasses.replace(c.ssh, hosts=()) == SSHSpec()


def test_every_field_of_every_block_is_known_to_the_validator():
    """A field added to a dataclass is accepted from a file with no other change (and a typo is not)."""
    def walk(cls, path=""):
        for name, rule in rules(cls).items():
            if rule.block is not None:
                yield from walk(rule.block, f"{path}{name}.")
            elif not rule.internal:
                yield f"{path}{name}", rule
    recipe_keys = {k for k, _ in walk(RecipeSpec)}
    assert {"launch.parallelism.cp", "health.stall_timeout", "model.dtype", "data.max_samples",
            "checkpoint.save_on_signal", "launch.secret_env", "tokenizer", "trainer"} <= recipe_keys
    assert "source" not in recipe_keys
    cluster_keys = {k for k, _ in walk(ClusterSpec)}
    assert {"ssh.hosts", "ssh.connect_timeout", "slurm.max_restarts", "slurm.extra_sbatch", "env"} <= cluster_keys
    kinds = dict(walk(RecipeSpec))
    assert kinds["launch.nodes"].kind == "pos_int" and kinds["launch.parallelism.cp"].kind == "opt_pos_int"
    assert kinds["health.stall_timeout"].kind == "pos_number"  # float: a duration, > 0
    assert kinds["model.dtype"].choices == ("auto", "float32", "bfloat16", "float16")
    assert kinds["recipe"].required and kinds["model.name_or_path"].required and not kinds["launch.nodes"].required


def test_problems_of_every_depth_collected_with_key_paths():
    d = dict(MINIMAL, health={"stall_timeout": 0, "stack_dumps": "no"}, tokenizer=3,
             launch={"parallelism": {"cp": 0, "sp": "2"}, "mixed_precision": "bf17", "port": 0},
             checkpoint="x", recipes="sft")
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, source="r.yaml")
    p = problems(e.value)
    assert p == {
        "recipes": "unknown key (did you mean 'recipe'?)",
        "tokenizer": "must be a non-empty string",
        "checkpoint": "must be a mapping, got str",
        "launch.mixed_precision": "must be one of null, no, bf16, fp16, got 'bf17' (did you mean 'bf16'?)",
        "launch.parallelism.cp": "must be an integer >= 1, got 0",
        "launch.parallelism.sp": "must be an integer >= 1, got '2'",
        "launch.port": "must be a port number 1-65535, got 0",
        "health.stall_timeout": "must be a number > 0, got 0",
        "health.stack_dumps": "must be true or false, got 'no'",
    }
    assert e.value.exit_code == 2


def test_internal_fields_are_not_input_and_empty_blocks_are_defaults():
    with pytest.raises(ConfigError, match="source: unknown key"):
        parse_recipe(dict(MINIMAL, source="x"))
    r = parse_recipe(dict(MINIMAL, trainer=None, launch={"env": None}, checkpoint=None))
    assert r.trainer == {} and r.launch.env == {} and r.checkpoint.resume == "auto"
    with pytest.raises(ConfigError, match="<top level>: must be a mapping, got list"):
        parse_recipe([1, 2])


def test_cluster_round_trips_through_plain_data():
    c = parse_cluster({"kind": "slurm", "env": {"A": 1}, "slurm": {"setup": ["module load x"], "gpus_per_node": 2}},
                      source="site.yaml")
    assert cluster_from_dict(cluster_to_dict(c)) == c
    s = parse_cluster({"kind": "ssh", "ssh": {"hosts": "n[1-2]"}}, source="lab.yaml")
    assert cluster_from_dict(cluster_to_dict(s)) == s and s.name == "lab"


def test_recipe_to_dict_is_plain_yaml_data():
    import yaml
    r = parse_recipe(dict(MINIMAL, data={"path": ["a", "b"]}, launch={"secret_env": ["HF_TOKEN"]}), source="r.yaml")
    d = r.to_dict()
    assert "source" not in d and d["data"]["path"] == ["a", "b"] and d["launch"]["secret_env"] == ["HF_TOKEN"]
    assert parse_recipe(yaml.safe_load(yaml.safe_dump(d)), source="r.yaml") == r


def test_one_definition_of_the_secret_rule_in_core():
    text = (REPO / "orchestrator" / "core" / "schema.py").read_text()
    assert text.count("def is_secret_name(") == 1
    for p in (REPO / "orchestrator" / "core").glob("*.py"):
        if p.name != "schema.py":
            assert "def is_secret_name(" not in p.read_text(), p


def test_omegaconf_stays_lazy():
    code = "import sys, orchestrator.core.spec, orchestrator.core.plan; print('omegaconf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr


MERGES = [  # (layers...): merged without omegaconf where plain (core.spec._merge), by it otherwise: the same result
    ({"a": {"b": 1, "c": [1, {"d": 2}]}, "e": None}, {"a": {"b": 3}, "f": "x"}),
    ({"a": {"b": 1}}, {"a": None}), ({"a": None}, {"a": {"b": 1}}), ({"a": {"b": 1}}, {"a": 5}),
    ({"a": 5}, {"a": {"b": 1}}), ({"a": 5}, {"a": [1]}), ({"a": [1]}, {"a": 5}), ({"a": [1, 2]}, {"a": [3]}),
    ({"a": [{"x": 1}]}, {"a": [{"y": 2}]}), ({"a": "???"},), ({"a": "${b}", "b": 3},), ({"a": {"b": "${c}"}, "c": 1},),
    ({"a": 1.5, "b": True, "c": None, "d": "x", "e": [1, {"f": 2}]}, {}, {"g": {"h": {"i": 1}}}), ({1: 2},),
    ({"launch": {"nodes": 1, "profile": "zero2"}, "run": {"script": "t.py", "args": ["--lr", 1e-4]}},
     {"launch": {"nodes": 2}}, {"run": {"args": ["--x"]}, "trainer": {"max_steps": 3}}),
]


@pytest.mark.parametrize("layers", MERGES)
def test_merge_is_omegaconfs(layers):
    from omegaconf import OmegaConf
    from orchestrator.core.spec import _merge
    try:
        want = OmegaConf.to_container(OmegaConf.merge(*[OmegaConf.create(x) for x in layers if x]), resolve=True)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            _merge(*layers)
        return
    got = _merge(*layers)
    assert got == want and type(got) is type(want)
    assert all(got is not x for x in layers)


@pytest.mark.parametrize("layers", [({"a": {"b": [1, {"c": "x"}]}}, {"a": {"d": 2.5}}), ({"a": 1}, {}, {"b": None})])
def test_plain_merges_leave_omegaconf_unimported(layers):
    code = ("import sys; from orchestrator.core.spec import _merge; "
            f"print(_merge(*{layers!r}), 'omegaconf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


# ------------------------------------------------------------------------------ hosts
@pytest.mark.parametrize("host", ["gpu01", "gpu01.lab.example", "gpu01.lab.example.", "127.0.0.2", "::1",
                                  "fe80::1%eth0", "2001:db8::7", "a-b", "x" * 63, "9front"])
def test_valid_hosts(host):
    assert is_host(host)


@pytest.mark.parametrize("host", ["127.0.0.2;rm -rf /", "-bad", "bad-", "a..b", "host:22", "user@host", "a b",
                                  "999.1.1.1", "1.2.3", "x" * 64, "$(reboot)", "h`id`", "", "gpu_01", "a/b"])
def test_invalid_hosts(host):
    assert not is_host(host)


def test_ssh_hosts_are_refused_by_entry():
    with pytest.raises(ConfigError) as e:
        parse_cluster({"kind": "ssh", "ssh": {"hosts": ["127.0.0.2;rm -rf /", "127.0.0.3", "n[1-2];x", "g[1-"]}},
                      source="c.yaml")
    p = problems(e.value)
    assert p["ssh.hosts[0]"] == "'127.0.0.2;rm -rf /' is not a valid host name or IP address"
    assert p["ssh.hosts[2]"] == "'n1;x', 'n2;x' are not valid host names or IP addresses (from 'n[1-2];x')"
    assert "unbalanced '['" in p["ssh.hosts[3]"]
    assert "ssh.hosts[1]" not in p
    assert str(e.value).startswith("c.yaml: 3 problems: ssh.hosts[0]: '127.0.0.2;rm -rf /' is not a valid host")
    with pytest.raises(ConfigError, match=r"^<cluster>: ssh.hosts: .gpu01 gpu02. is not a valid host name"):
        parse_cluster({"kind": "ssh", "ssh": {"hosts": "gpu01 gpu02"}})
    hosts, probs = expand_hosts("gpu[01-02].lab,::1", "ssh.hosts")
    assert hosts == ("gpu01.lab", "gpu02.lab", "::1") and probs == []


def test_hostfile_hosts_are_checked_by_line(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# lab\n127.0.0.2 slots=8\n\n127.0.0.3;reboot\nnode[1-2]\n")
    with pytest.raises(ConfigError) as e:
        parse_hostfile(hf.read_text(), str(hf))
    assert problems(e.value) == {f"{hf}:4": "'127.0.0.3;reboot' is not a valid host name or IP address"}
    assert parse_hostfile("a\nb slots=2\nn[1-2]  # two\n", "h") == ["a", "b", "n1", "n2"]
    with pytest.raises(ConfigError, match="h: duplicate hosts: a"):
        parse_hostfile("a\nb\na\n", "h")
    with pytest.raises(ConfigError, match="h: hostfile lists no hosts"):
        parse_hostfile("# nothing\n", "h")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe: sft\nmodel: {name_or_path: tiny-llama}\ndata: {path: d.jsonl}\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"kind: ssh\nssh:\n  hostfile: {hf}\n")
    with pytest.raises(ConfigError, match=f"{hf}:4: '127.0.0.3;reboot' is not a valid host"):
        load(str(recipe), str(cluster))
    hf.write_text("127.0.0.2\n127.0.0.3\n")
    assert load(str(recipe), str(cluster))[1].ssh.hosts == ("127.0.0.2", "127.0.0.3")


def test_build_is_generic_over_spec_dataclasses():
    h, probs = build(HealthSpec, {"max_restarts": -1, "poll_interval": 0.5, "stall_timout": 3})
    assert h is None and {p.where: p.message for p in probs} == {
        "stall_timout": "unknown key (did you mean 'stall_timeout'?)",
        "max_restarts": "must be an integer >= 0, got -1"}
    h, probs = build(HealthSpec, {"poll_interval": 0.5})
    assert probs == [] and h == HealthSpec(poll_interval=0.5)

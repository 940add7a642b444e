"""The command line as a user meets it: exit codes, one-line errors naming the key, nothing written
on bad input, a fast `--help` that does not import torch, and every shipped YAML valid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli, spawn

REPO = Path(__file__).resolve().parents[2]


def run(*args, cwd=REPO, env=None):
    return cli(*args, cwd=cwd, env=env)


def test_help_is_fast_and_imports_nothing_heavy():
    code = ("import sys, time; t = time.perf_counter(); from orchestrator.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'deepspeed', 'paramiko', 'submitit', 'accelerate', "
            "'omegaconf', 'rich', 'starlette', 'uvicorn') if m in sys.modules]\n"
            "print('HEAVY', heavy, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "HEAVY []" in out.stderr, out.stderr
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "--help"], capture_output=True, cwd=REPO)
        times.append(time.perf_counter() - t0)
        assert r.returncode == 0 and b"submit" in r.stdout
    times.sort()
    print(f"orchestrate --help median {times[2]:.3f}s")
    assert times[2] <= 0.3


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("orchestrate ")


def test_bad_recipe_is_one_line_exit_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: sft\nmodel: {name_or_path: tiny-llama}\ndata: {path: recipes/data/sft_tiny.jsonl}\n"
                   "launch: {nodez: 2, procs_per_node: 0}\ntrainer: {learning_rat: 0.1}\n")
    out = tmp_path / "out"
    r = run("render", bad, "--out", out)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "launch.nodez: unknown key (did you mean 'nodes'?)" in lines[0]
    assert "launch.procs_per_node: must be an integer >= 1, got 0" in lines[0]
    assert "trainer.learning_rat: unknown sft trainer option (did you mean 'learning_rate'?)" in lines[0]
    assert not out.exists()


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("recipe: sft\nmodel:\n  name_or_path: [tiny\n")
    r = run("render", bad, "--out", tmp_path / "o")
    assert r.returncode == 2
    assert f"{bad}:4: YAML syntax error" in r.stderr or f"{bad}:3: YAML syntax error" in r.stderr, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--nodes", "0"], "launch.nodes: must be an integer >= 1, got 0"),
    (["--profile", "zero4"], "launch.profile: unknown profile 'zero4'"),
    (["launch.nodes"], "override 'launch.nodes': must look like key.path=value"),
    (["--procs-per-node", "4", "launch.parallelism.sp=3", "--profile", "zero3"], "launch.parallelism"),
    (["data.path=missing/file.jsonl"], "data.path: file not found"),
    (["launch.env.WANDB_API_KEY=abc"], "launch.env.WANDB_API_KEY: looks like a secret"),
])
def test_bad_flags_and_overrides(tmp_path, args, needle):
    r = run("render", "recipes/configs/sft_tiny.yaml", "--out", tmp_path / "o", *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert not (tmp_path / "o").exists()


def test_profile_file_that_is_not_an_accelerate_config(tmp_path):
    prof = tmp_path / "prof.yaml"
    prof.write_text("distributed_typ: FSDP\nnum_processes: 2\n")
    r = run("render", "recipes/configs/sft_tiny.yaml", "--out", tmp_path / "o", "--profile", prof)
    assert r.returncode == 2 and "not an accelerate config: unknown keys distributed_typ" in r.stderr


def test_more_nodes_than_hosts(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("kind: ssh\nssh:\n  hosts: [127.0.0.2, 127.0.0.3]\n")
    r = run("render", "recipes/configs/sft_tiny.yaml", "--nodes", "3", "--cluster", cluster, "--out", tmp_path / "o")
    assert r.returncode == 2 and "3 nodes asked but cluster 'c' lists only 2 host(s)" in r.stderr


def test_render_writes_plan_and_every_node(tmp_path):
    out = tmp_path / "plan"
    r = run("render", "recipes/configs/sft_tiny.yaml", "--nodes", "3", "--out", out, "trainer.max_steps=7")
    assert r.returncode == 0, r.stderr
    assert "world      3 node(s) x 1 process(es) = 3" in r.stdout
    for n in range(3):
        assert (out / "nodes" / str(n) / "accelerate.yaml").is_file()
        assert "recipes.run" in (out / "nodes" / str(n) / "command.txt").read_text()
    import json
    plan = json.loads((out / "plan.json").read_text())
    assert plan["nodes"] == 3 and plan["world_size"] == 3
    import yaml
    assert yaml.safe_load((out / "recipe.yaml").read_text())["trainer"]["max_steps"] == 7
    assert (out.stat().st_mode & 0o077) == 0
    r = run("render", "recipes/configs/sft_tiny.yaml", "--out", tmp_path / "j", "--json")
    assert json.loads(r.stdout)["world_size"] == 1


def test_render_never_mixes_two_plans_in_one_directory(tmp_path):
    """issue #37 item 3: a directory holding another plan, or other files, is refused (exit 2, one line) unless
    --force, which removes only render's own files; the same job rendered again replaces its earlier render."""
    from orchestrator import client
    from orchestrator.errors import ConfigError
    out = tmp_path / "plan"
    client.render("recipes/configs/sft_tiny.yaml", nodes=3, run_dir=str(out)).write(out)
    client.render("recipes/configs/sft_tiny.yaml", nodes=2, run_dir=str(out)).write(out)  # same job: replaced
    assert sorted(p.name for p in (out / "nodes").iterdir()) == ["0", "1"]
    r = run("render", "recipes/configs/dpo_tiny.yaml", "--out", out)  # another job's plan
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"--out: {out} holds the plan of job sft_tiny-" in r.stderr and "--force" in r.stderr
    assert __import__("json").loads((out / "plan.json").read_text())["recipe_name"] == "sft_tiny"  # untouched
    (out / "notes.txt").write_text("mine")
    r = run("render", "recipes/configs/dpo_tiny.yaml", "--out", out, "--force")
    assert r.returncode == 0, r.stderr
    assert __import__("json").loads((out / "plan.json").read_text())["recipe_name"] == "dpo_tiny"
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in (out / "nodes").iterdir()) == ["0"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("x")
    with pytest.raises(ConfigError, match=r"is not empty \(1 file\(s\) render does not write, e.g. data.csv\)"):
        client.render("recipes/configs/sft_tiny.yaml").write(other)
    client.render("recipes/configs/sft_tiny.yaml").write(other, force=True)
    assert (other / "data.csv").read_text() == "x" and (other / "plan.json").is_file()


def test_an_unknown_id_is_no_job_or_sweep(tmp_path):
    """issue #37 item 9: every command that takes a job or a sweep id says so in one line (exit 2)."""
    for command in ("status", "logs", "attach", "plot", "cancel"):
        r = run(command, "sweep-nope", env={"ORCHESTRATE_HOME": str(tmp_path)})
        assert r.returncode == 2 and r.stderr == "orchestrate: error: no job or sweep 'sweep-nope' (see `orchestrate " \
            "ls`)\n", (command, r.stderr)


def test_a_dry_run_asks_no_host_and_names_the_facts_it_lacks(tmp_path):
    """issue #37 item 6: render / submit --dry-run of an SSH GPU cluster whose plan needs the hosts' GPU counts and
    container runtimes connects to no host (the one host is a socket of this test's, with a real key: any connection
    attempt would wait there) and names each fact and how to give it, in one line, exit 2."""
    import socket
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")], check=True)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        cluster = tmp_path / "c.yaml"
        cluster.write_text(f"kind: ssh\naccelerator: gpu\nssh:\n  hosts: [127.0.0.1]\n  port: {srv.getsockname()[1]}\n"
                           f"  key: {tmp_path / 'key'}\n  known_hosts: {tmp_path / 'known_hosts'}\n"
                           "  strict_host_keys: false\n  connect_timeout: 2\n")
        for argv in (["render", "--out", tmp_path / "o"], ["submit", "--dry-run"]):
            r = run(argv[0], "recipes/configs/sft_tiny.yaml", "--cluster", cluster, *argv[1:],
                    "container.image=docker.io/library/python:3.12", env={"ORCHESTRATE_HOME": str(tmp_path / "h")})
            assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert ("ssh.gpus_per_node: launch.procs_per_node auto needs each host's GPU count, which a dry run does "
                    "not ask the hosts: give ssh.gpus_per_node in the cluster file") in r.stderr, r.stderr
            assert "container.runtime: auto needs the runtimes the hosts have" in r.stderr and "--probe" in r.stderr
        srv.settimeout(0.2)
        with pytest.raises(socket.timeout):
            srv.accept()  # nobody knocked
    assert not (tmp_path / "o").exists()


SHIPPED = sorted((REPO / "recipes" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_recipe_validates_and_plans(path, tmp_path):
    from orchestrator import api
    prep = api.prepare(str(path), cwd=REPO)
    assert prep.plan.world_size >= 1


CLUSTERS = sorted((REPO / "cluster_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CLUSTERS, ids=[p.name for p in CLUSTERS])
def test_every_shipped_cluster_validates(path):
    from orchestrator.core.spec import parse_cluster, read_yaml
    parse_cluster(read_yaml(path, "cluster"), source=str(path))


CHECK_SIGINT = ("import signal, sys; h = signal.getsignal(signal.SIGINT); "
                "print('ignored' if h is signal.SIG_IGN else 'python' if h is signal.default_int_handler else h, "
                "flush=True); sys.exit(0) if len(sys.argv) < 2 else signal.pause()")


def test_children_get_ctrl_c_even_when_pytest_ignores_sigint():
    """A background `bash .ci/run &` starts pytest with SIGINT ignored, and an ignored disposition survives exec:
    a test's child must not inherit it (helpers.spawn resets it), else a Ctrl-C test passes or fails by accident."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plain = subprocess.run([sys.executable, "-c", CHECK_SIGINT], capture_output=True, text=True, timeout=60)
        assert plain.stdout.strip() == "ignored"  # the trap the helper exists for
        p = spawn([sys.executable, "-c", CHECK_SIGINT, "wait"], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "python"
            assert os.getpgid(p.pid) == p.pid != os.getpgrp()  # a group of its own
            p.send_signal(signal.SIGINT)
            assert p.wait(timeout=30) != 0  # KeyboardInterrupt ended it
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
    finally:
        signal.signal(signal.SIGINT, old)

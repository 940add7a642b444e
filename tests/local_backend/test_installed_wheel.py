"""Installed as a user would (issue #37): a wheel built from this checkout, `pip install`ed (not editable) into a fresh
virtualenv, works from an empty directory with no checkout on sys.path: every accelerate profile, the default local
cluster and the shipped cluster files, the built-in recipes and their data, the node package and its hooks, and
`orchestrate plot` (matplotlib is a dependency).

The fresh venv gets the heavy stack (torch, accelerate, TRL, ...) cheaply: a .pth naming this interpreter's
site-packages, whose own .pth files (the editable install of orchestrate among them) are not run, so the only
`orchestrator` it can import is the wheel's. The wheel is built from a copy of the package folders, so no build
output lands in the checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from helpers import OFFLINE_ENV, PYTHON, heartbeats, run

REPO = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("orchestrator", "launchers", "recipes", "cluster_configs")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """{bin, site, env, cwd}: a venv holding only the wheel of this checkout (+ the stack through a .pth), and an
    environment without PYTHONPATH, run from an empty directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in PACKAGE_FOLDERS:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
             str(src)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp / "dist").glob("orchestrate-*.whl"))
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    r = run([PYTHON, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    check=True).stdout.strip())
    (site / "zz_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the venv's own packages
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OFFLINE_ENV, PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    empty = tmp / "empty"
    empty.mkdir()
    return {"bin": env_dir / "bin", "site": site, "env": env, "cwd": empty}


def orchestrate(inst: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run([str(inst["bin"] / "orchestrate"), *args], env=inst["env"], cwd=inst["cwd"], timeout=timeout)


def test_the_wheel_alone_renders_and_runs_two_nodes_from_an_empty_directory(installed, job_guard, tiny_model):
    inst, site = installed, str(installed["site"])
    # what the venv imports is the wheel's, and every shipped profile, cluster file, recipe and its data is found
    probe = ("import json, orchestrator, recipes, launchers, orchestrator.node.hooks as h\n"
             "from orchestrator.core.schema import PROFILES\n"
             "from orchestrator.resources import profile_path, shipped\n"
             "print(json.dumps({'mods': [orchestrator.__file__, recipes.__file__, launchers.__file__, h.HOOKS_DIR],\n"
             "    'profiles': {p: str(profile_path(p)) for p in PROFILES if profile_path(p).is_file()},\n"
             "    'files': [str(shipped(f)) for f in ('cluster_configs/local.yaml', 'recipes/configs/sft_tiny.yaml',\n"
             "              'recipes/configs/dpo_tiny.yaml', 'recipes/data/sft_tiny.jsonl',\n"
             "              'recipes/data/dpo_tiny.jsonl')]}))\n")
    r = run([str(inst["bin"] / "python"), "-c", probe], env=inst["env"], cwd=inst["cwd"])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert all(m.startswith(site) for m in got["mods"]), got["mods"]
    assert set(got["profiles"]) == {"multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2", "context_parallel",
                                    "alst_ulysses"} and all(p.startswith(site) for p in got["profiles"].values())
    assert all(f.startswith(site) for f in got["files"]), got["files"]
    assert sys.modules["orchestrator"].__file__ not in got["mods"]

    # render with a profile, the default (built-in local) cluster, the built-in recipe named by its checkout path
    r = orchestrate(inst, "render", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--profile", "zero3",
                    "--out", "plan")
    assert r.returncode == 0, r.stdout + r.stderr
    acc = (inst["cwd"] / "plan" / "nodes" / "1" / "accelerate.yaml").read_text()
    assert "zero_stage: 3" in acc and "machine_rank: 1" in acc, acc
    recipe = (inst["cwd"] / "plan" / "recipe.yaml").read_text()
    assert f"{site}/recipes/data/sft_tiny.jsonl" in recipe, recipe

    # a real 2-node job on the shipped local cluster file: both ranks train through the wheel's node package
    r = orchestrate(inst, "submit", "recipes/configs/sft_tiny.yaml", "--nodes", "2", "--cluster",
                    "cluster_configs/local.yaml", "trainer.max_steps=2", "trainer.logging_steps=1", timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    m = re.search(r"^job (\S+) COMPLETED", text, re.MULTILINE)
    assert m, text[-3000:]
    run_dir = Path(os.environ["ORCHESTRATE_HOME"]) / "runs" / m.group(1)
    for rank in (0, 1):
        beats = heartbeats(run_dir, rank)
        assert any(b["event"] == "step" and b["step"] == 2 for b in beats), beats[-3:]
    assert (inst["cwd"] / "outputs" / "sft_tiny").is_dir()
    r = orchestrate(inst, "plot", m.group(1), "--out", "loss.png")  # plot works after a plain install
    assert r.returncode == 0 and (inst["cwd"] / "loss.png").read_bytes()[:4] == b"\x89PNG", r.stdout + r.stderr

"""Containers, rendered (issue #25): the exact command each node runs and the standalone job.sbatch, byte for byte,
for pyxis (flags on the task step), apptainer (`apptainer exec --nv --bind ...` around the launcher), enroot and
podman/docker; and the one builder's rules (mounts, names, secrets never on a command line). UPDATE_GOLDEN=1
rewrites the goldens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from helpers import assert_golden
from launchers.slurm.launcher import SlurmLauncher
from orchestrator.resources import profile_path
from orchestrator.core.container import (ContainerPlan, Mount, container_name, job_mounts, node_argv, parse_mount,
                                         visible)
from orchestrator.core.plan import PlanFacts, make_plan
from orchestrator.core.render import render_files
from orchestrator.core.spec import parse_cluster, parse_recipe
from orchestrator.errors import ConfigError

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "containers"
RECIPE = {"recipe": "sft", "model": {"name_or_path": "/models/llama"}, "data": {"path": "/data/sft.jsonl"},
          "trainer": {"max_steps": 30, "output_dir": "/home/user/project/out"},
          "launch": {"secret_env": ["HF_TOKEN"], "nodes": 2, "procs_per_node": 4}}
SLURM = {"kind": "slurm", "slurm": {"gpus_per_node": 4, "partition": "gpu", "time": "02:00:00",
                                     "workdir": "/shared/orchestrate", "python": "/shared/venv/bin/python"}}
CASES = {  # name: (cluster, container block)
    "slurm_pyxis": (SLURM, {"image": "nvcr.io/nvidia/pytorch:25.01-py3", "runtime": "pyxis",
                            "mounts": ["/data:/data:ro", "/models:/models:ro"], "env": {"NCCL_DEBUG": "INFO"}}),
    "slurm_apptainer": (SLURM, {"image": "/shared/images/pytorch.sif", "runtime": "apptainer",
                                "mounts": ["/data:/data:ro", "/models"]}),
    "slurm_enroot": (SLURM, {"image": "/shared/images/pytorch.sqsh", "runtime": "enroot",
                             "mounts": ["/data:/data:ro", "/models:/models:ro"]}),
    "ssh_docker": ({"kind": "ssh", "ssh": {"hosts": ["gpu01", "gpu02"], "shared_fs": True}},
                   {"image": "registry.example.com/team/train:1.4", "runtime": "docker",
                    "mounts": ["/data:/data:ro", "/models:/models:ro"], "options": ["--shm-size=16g"]}),
}


def build(name: str):
    cluster, container = CASES[name]
    recipe = parse_recipe(dict(RECIPE, container=container), source=f"{name}.yaml")
    c = parse_cluster(cluster, source=f"{name}-cluster.yaml")
    cfg = yaml.safe_load(profile_path("multi_gpu").read_text())
    run_dir = f"/shared/orchestrate/runs/{name}-job"
    facts = PlanFacts(job_id=f"{name}-job", run_dir=run_dir, output_dir="/home/user/project/out",
                      python="/shared/venv/bin/python", port=29500, accelerator="gpu", profile_name="multi_gpu",
                      profile_config=cfg, hosts=c.ssh.hosts if c.ssh else (), cwd="/home/user/project",
                      package_root="/shared/venv/lib/python3.11/site-packages")
    plan = make_plan(recipe, c, facts)
    plan = dataclasses.replace(plan, rank_cwd="/home/user/project", package_root=facts.package_root)  # (as api does)
    files = render_files(plan, recipe.to_dict())
    if c.kind == "slurm":
        files.update(SlurmLauncher(c).prepare(plan).files)
    return plan, files


@pytest.mark.parametrize("name", sorted(CASES))
def test_container_golden(name):
    plan, files = build(name)
    assert build(name)[1] == files  # deterministic
    assert_golden(GOLDEN / name, files)
    text = "\n".join(files.values())
    assert "HF_TOKEN=***" in files["nodes/0/command.txt"] and "HF_TOKEN=" not in text.replace("HF_TOKEN=***", "")


def test_pyxis_puts_the_flags_on_the_task_step_and_the_agent_in_the_image():
    plan, files = build("slurm_pyxis")
    script = files["job.sbatch"]
    srun = script[script.index("srun --kill-on-bad-exit"):script.index("SRUN_PID=$!")]
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in srun
    assert ("--container-mounts=/shared/orchestrate/runs/slurm_pyxis-job:/shared/orchestrate/runs/slurm_pyxis-job:rw,"
            "/home/user/project:/home/user/project:rw,"
            "/shared/venv/lib/python3.11/site-packages/orchestrator:/opt/orchestrate/orchestrator:ro,"
            "/shared/venv/lib/python3.11/site-packages/recipes:/opt/orchestrate/recipes:ro,"
            "/data:/data:ro,/models:/models:ro") in srun
    assert "--no-container-mount-home" in srun and "--container-workdir=/home/user/project" in srun
    assert "--container-env=PYTHONPATH" in srun  # (NCCL_DEBUG: in the plan's env, which the agent gives the ranks)
    assert "python3 -m orchestrator.node" in srun  # the image's python runs the agent, from the mounted package
    assert "export PYTHONPATH=/opt/orchestrate" in script
    # the requeue decision runs in the batch shell (outside the image) with the cluster's python
    assert '"$PYTHON" -m launchers.slurm.task requeue' in script and "PYTHON=/shared/venv/bin/python" in script
    assert SlurmLauncher(parse_cluster(SLURM)).prepare(plan).extra["pyxis"] is True


def test_apptainer_wraps_the_launcher_and_the_agent_stays_outside():
    plan, files = build("slurm_apptainer")
    cmd = files["nodes/1/command.txt"]
    assert ("apptainer exec --nv --bind /shared/orchestrate/runs/slurm_apptainer-job:"
            "/shared/orchestrate/runs/slurm_apptainer-job:rw,/home/user/project:/home/user/project:rw,"
            "'${NODE_PACKAGE}/orchestrator:/opt/orchestrate/orchestrator:ro',") not in cmd  # one word, quoted whole
    line = cmd.strip().splitlines()[-1]
    inner = ("/shared/images/pytorch.sif python3 -m accelerate.commands.launch --config_file "
             "/shared/orchestrate/runs/slurm_apptainer-job/nodes/1/accelerate.yaml")
    assert line.startswith("apptainer exec --nv --bind ") and f" {inner}" in line, line
    assert "--pwd /home/user/project" in line and "/models:/models:rw" in line
    assert "srun" not in line and "--container-image" not in files["job.sbatch"]
    assert "-m orchestrator.node" in files["job.sbatch"]  # the node agent runs on the host, starts apptainer


def test_podman_line_names_labels_and_shares_the_host_namespaces():
    cp = ContainerPlan(runtime="podman", image="img:1", mounts=(Mount("/data", "/data", "ro"),), gpus=True)
    argv = node_argv(cp, ["python3", "-m", "accelerate.commands.launch"], job_id="j-1", node_rank=3,
                     run_dir="/w/runs/j-1", package="/pkg", cwd="/w/runs/j-1/staged/code", env_names=["HF_TOKEN", "A"],
                     token="tok", roots=("/w",))
    assert argv[:5] == ["podman", "run", "--rm", "--name", container_name("j-1", 3)] == argv[:4] + ["orch-j-1-n3"]
    assert ["--label", "orchestrate.job=j-1"] == argv[5:7]
    for flag in (["--network", "host"], ["--ipc", "host"], ["--pid", "host"], ["--device", "nvidia.com/gpu=all"]):
        assert any(argv[i:i + 2] == flag for i in range(len(argv))), flag
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert mounts == ["/w:/w:rw", "/pkg/orchestrator:/opt/orchestrate/orchestrator:ro",
                      "/pkg/recipes:/opt/orchestrate/recipes:ro", "/data:/data:ro"]  # run dir and cwd: under /w
    assert "--env" in argv and "HF_TOKEN" in argv and not any("HF_TOKEN=" in a for a in argv)  # by name only
    assert "ORCHESTRATE_JOB_TOKEN=tok" in argv  # the launch's marker: on the line, not a secret
    assert argv[argv.index("-w") + 1] == "/w/runs/j-1/staged/code"
    assert argv[-4:] == ["img:1", "python3", "-m", "accelerate.commands.launch"]


@pytest.mark.parametrize("text, why", [
    ("data:/data", "host path must be absolute"), ("/data:data", "container path must be absolute"),
    ("/a:/b:rx", "mode must be ro or rw"), ("/a:/b:ro:x", "must be HOST:CONTAINER"), ("/a,b:/c", "comma"),
    ("", "must be HOST:CONTAINER"),
])
def test_bad_mounts_are_named(text, why):
    m, msg = parse_mount(text)
    assert m is None and why in msg


def test_a_path_is_visible_only_at_its_own_path():
    mounts = job_mounts(ContainerPlan("podman", "i", (Mount("/data", "/mnt/data", "ro"),)), run_dir="/r",
                        package="/r/pkg", cwd="/home/u/p")
    assert visible(mounts, "/r/x") and visible(mounts, "/home/u/p/a.jsonl")
    assert not visible(mounts, "/data/a.jsonl")  # mounted, but elsewhere: the plan's path would not resolve
    assert visible(mounts, "/r/pkg/orchestrator/x")  # under /r (the package is ALSO mounted at /opt/orchestrate)
    assert not visible(mounts, "/etc/hosts")


@pytest.mark.parametrize("container, key", [
    ({"image": "i", "runtime": "pyxis"}, "container.runtime: pyxis runs containers only on SLURM"),
    ({"image": "x.sif", "runtime": "podman"}, "container.image: x.sif: a .sif file runs with apptainer"),
    ({"image": "/img", "runtime": "docker"}, "container.image: docker runs an image by name"),
    ({"runtime": "podman", "mounts": ["/a"]}, "container.image: missing"),
    ({"image": "i", "runtime": "podman", "env": {"PYTHONPATH": "/x"}}, "container.env.PYTHONPATH: set by orchestrate"),
    ({"image": "i", "runtime": "podman"}, "/elsewhere/data.jsonl (data.path) is not visible in the container"),
])
def test_plan_refuses_what_cannot_run(container, key):
    recipe = parse_recipe(dict(RECIPE, container=container, data={"path": "/elsewhere/data.jsonl"},
                               launch={"nodes": 2, "procs_per_node": 1}))
    facts = PlanFacts(job_id="j", run_dir="/r/runs/j", output_dir="/home/u/out", python="python", port=1,
                      accelerator="cpu", profile_name="multi_gpu", profile_config={"distributed_type": "MULTI_GPU"},
                      cwd="/home/u", package_root="/pkg")
    with pytest.raises(ConfigError) as e:
        make_plan(recipe, parse_cluster({"kind": "local"}), facts)
    assert key in str(e.value), str(e.value)

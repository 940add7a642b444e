"""Pure tests of the SLURM backend (no cluster): job.sbatch golden files, the state table, the slurm
block checks, the restart policy, and the two silent multi-node failures ruled out by construction.
Regenerate the golden files with UPDATE_GOLDEN=1."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.core.health import HealthSpec

from launchers.slurm.sbatch import (array_problems, array_spec, check_slurm, render_array_sbatch, render_sbatch,
                                    time_seconds)
from launchers.slurm.launcher import STATE_TABLE, SlurmLauncher, job_id_of, map_state
from launchers.slurm.task import may_requeue
from orchestrator.errors import ConfigError
from orchestrator.core.hostlist import expand, first_host
from orchestrator.core.jobplan import LATE_MAIN_IP, LaunchPlan, NodePlan
from orchestrator.core.spec import SlurmSpec, parse_cluster, read_yaml

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "slurm"


def fixed_plan(nodes: int = 2, run_dir: str = "/shared/orchestrate/runs/sft_tiny-20250101-000000-abcd",
               python: str = "python") -> LaunchPlan:
    cmd = (python, "-m", "accelerate.commands.launch", "--config_file", f"{run_dir}/nodes/0/accelerate.yaml",
           "-m", "recipes.run", f"{run_dir}/recipe.yaml")
    nps = tuple(NodePlan(node_rank=r, host="", ranks=tuple(range(r * 8, r * 8 + 8)),
                         accelerate_config={"distributed_type": "MULTI_GPU", "machine_rank": r,
                                            "main_process_ip": LATE_MAIN_IP, "num_machines": nodes},
                         command=cmd, env={"NCCL_DEBUG": "WARN"}) for r in range(nodes))
    return LaunchPlan(job_id=Path(run_dir).name, recipe="sft", recipe_name="sft_tiny", cluster_kind="slurm",
                      cluster_name="example_site", accelerator="gpu", profile="multi_gpu", distributed_type="MULTI_GPU",
                      nodes=nodes, procs_per_node=8, world_size=8 * nodes,
                      parallelism={"dp_replicate": 1, "dp_shard": 8 * nodes, "tp": 1, "cp": 1, "sp": 1},
                      data_parallel_size=8 * nodes, per_device_batch=8, grad_accum=1, effective_batch=64 * nodes,
                      max_length=256, tokens_per_step=None, tokens_per_step_exact=False, main_host=LATE_MAIN_IP,
                      port=29500, run_dir=run_dir, output_dir="/shared/out", python=python, secret_env=("HF_TOKEN",),
                      node_plans=nps, health=HealthSpec(max_restarts=3))


def cluster(name: str):
    path = REPO / "cluster_configs" / f"{name}.yaml"
    return parse_cluster(read_yaml(str(path), "cluster"), str(path))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from the golden file (UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("cluster_name,nodes", [("slurm_example", 4), ("slurm_local", 2)])
def test_sbatch_golden(cluster_name, nodes):
    c = cluster(cluster_name)
    plan = fixed_plan(nodes=nodes, python=c.slurm.python)
    text = render_sbatch(plan, c.slurm)
    check_golden(f"{cluster_name}.sbatch", text)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # valid shell


def test_sbatch_options():
    c = cluster("slurm_example")
    text = render_sbatch(fixed_plan(4), c.slurm)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --account=my-project", "#SBATCH --qos=normal", "#SBATCH --time=12:00:00",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=64", "#SBATCH --mem=480G",
                 "#SBATCH --constraint=h100", "#SBATCH --exclusive", "#SBATCH --signal=B:USR2@300",
                 "#SBATCH --requeue", "#SBATCH --mail-type=FAIL", "module load cuda/12.4"):
        assert line in text.splitlines(), line
    # all #SBATCH lines come before the first command (sbatch stops reading them there)
    lines = text.splitlines()
    last_sbatch = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    first_cmd = min(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert last_sbatch < first_cmd
    assert "HF_TOKEN" not in text  # secret names travel with the plan, values never


def test_rank_is_never_bound_in_the_batch_shell():
    """Silent failure 2 (every node rank 0, a hang): nothing node-specific is expanded in the batch shell;
    the srun'd command is the node agent, which binds SLURM_NODEID inside each task."""
    text = render_sbatch(fixed_plan(2), cluster("slurm_local").slurm)
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    for var in ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "machine_rank", "--node-rank", "--machine_rank",
                "scontrol show hostnames", "--main-ip"):
        assert var not in code, var
    srun = text[text.index("\nsrun "):].split("&\n")[0]
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun
    assert '"$PYTHON" -m orchestrator.node "$RUN_DIR"' in srun
    from orchestrator.node.agent import bind_main_ip, bind_rank
    for r in range(2):
        assert bind_rank(None, {"SLURM_NODEID": str(r)}, 2) == r
    assert bind_main_ip(None, LATE_MAIN_IP, {"SLURM_JOB_NODELIST": "node[1-2]"}) == "node1"


def test_cpu_plan_never_trains_each_node_alone():
    """Silent failure 1 (no --multi_gpu/--cpu: each node trains alone, exit 0): on a CPU SLURM cluster every
    node's accelerate config takes the torchrun path (MULTI_GPU, use_cpu false), which exports RANK and
    WORLD_SIZE to every process; main_process_ip is bound late on the node."""
    from orchestrator import api
    prep = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), str(REPO / "cluster_configs/slurm_local.yaml"),
                       nodes=2, cwd=REPO, check_trainer=False)
    assert prep.plan.world_size == 2 and prep.plan.main_host == LATE_MAIN_IP
    for node in prep.plan.node_plans:
        cfg = node.accelerate_config
        assert cfg["distributed_type"] == "MULTI_GPU" and cfg["use_cpu"] is False
        assert cfg["num_machines"] == 2 and cfg["num_processes"] == 2
        assert cfg["main_process_ip"] == LATE_MAIN_IP and node.host == ""
        assert node.env.get("GLOO_SOCKET_IFNAME") == "eth0"
    sub = SlurmLauncher(prep.cluster).prepare(prep.plan)
    assert "job.sbatch" in sub.files and sub.extra["submitit"]["ntasks_per_node"] == 1
    assert sub.extra["submitit"]["srun_args"] == ["--kill-on-bad-exit=1"]
    # submitit's own USR2 line must not be replaced (that breaks its requeue)
    assert "signal" not in sub.extra["submitit"]["additional_parameters"]


def test_slurm_block_checks():
    s = SlurmSpec(partition="gpu", time="00:01:00", signal_lead_s=120, gpus_per_node=9, max_gpus_per_node=8,
                  extra_sbatch=("--nodes=3", "not an option"))
    problems = {p.where: p.message for p in check_slurm(s, "site", procs_per_node=10, accelerator="gpu")}
    assert "nodes have 8" in problems["slurm.gpus_per_node"]
    assert "not longer than the preemption signal lead" in problems["slurm.time"]
    assert "set by orchestrate" in problems["slurm.extra_sbatch[0]"]
    assert "expected one option" in problems["slurm.extra_sbatch[1]"]
    assert "launch.procs_per_node" in problems
    assert check_slurm(SlurmSpec(time="bogus"), "site")[0].where == "slurm.time"
    plan = fixed_plan(2)
    c = replace(cluster("slurm_example"), slurm=s)
    with pytest.raises(ConfigError) as e:
        SlurmLauncher(c).prepare(plan)
    assert e.value.exit_code == 2 and "slurm.gpus_per_node" in str(e.value) and "slurm.time" in str(e.value)
    assert time_seconds("1-02:03:04") == 93784 and time_seconds("90") == 5400 and time_seconds("05:30") == 330


def test_tools_missing_is_a_config_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError) as e:
        SlurmLauncher(cluster("slurm_example")).preflight()
    assert e.value.exit_code == 2
    assert "example_site" in e.value.one_line() and "sbatch" in e.value.one_line()
    assert "\n" not in e.value.one_line()


def test_state_table():
    for raw, want in [("PENDING", ("PENDING", False)), ("RUNNING", ("RUNNING", False)),
                      ("COMPLETING", ("RUNNING", False)), ("REQUEUED", ("PENDING", False)),
                      ("COMPLETED", ("COMPLETED", True)), ("FAILED", ("FAILED", True)),
                      ("CANCELLED by 0", ("CANCELLED", True)), ("TIMEOUT", ("FAILED", True)),
                      ("PREEMPTED", ("FAILED", True)), ("NODE_FAIL", ("FAILED", True)),
                      ("OUT_OF_MEMORY", ("FAILED", True)), ("", ("UNKNOWN", False))]:
        assert map_state(raw)[:2] == want, raw
    assert map_state("CANCELLED by 0")[2] == "CANCELLED"
    assert all(isinstance(v, tuple) and len(v) == 2 for v in STATE_TABLE.values())
    assert job_id_of("slurm://1234") == "1234"
    with pytest.raises(ConfigError):
        job_id_of("ssh://x")


def test_hostlist_gives_the_main_host():
    assert expand("gpu[01-04,07]") == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
    assert first_host("node[1-2]") == "node1"


def test_restart_policy(tmp_path):
    hb = tmp_path / "heartbeats"
    hb.mkdir()
    (hb / "rank0.jsonl").write_text(json.dumps({"step": 10}) + "\n")
    assert may_requeue(tmp_path, 0, 3)[0]
    # no progress since the last requeue: a loop, stop
    ok, why = may_requeue(tmp_path, 1, 3)
    assert not ok and "no progress" in why
    (hb / "rank0.jsonl").write_text(json.dumps({"step": 20}) + "\n")
    assert may_requeue(tmp_path, 1, 3)[0]
    ok, why = may_requeue(tmp_path, 3, 3)
    assert not ok and "budget" in why
    decisions = [json.loads(x)["decision"] for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert decisions == ["restart", "stop", "restart", "stop"]


# ------------------------------------------------------------------------------- a sweep as ONE array job

SWEEP = "sweep-20250101-000000-abcd"


def sweep_points(n: int = 4, cluster_name: str = "slurm_local", budgets: tuple[int, ...] = (),
                 root: str = "/shared/orchestrate/runs"):
    c = cluster(cluster_name)
    out = []
    for i in range(n):
        plan = fixed_plan(2, run_dir=f"{root}/{SWEEP}-p{i}", python=c.slurm.python)
        if budgets:
            plan = replace(plan, health=HealthSpec(max_restarts=budgets[i]))
        out.append((plan, c.slurm))
    return out


def test_array_sbatch_golden():
    """A 4-point sweep with --max-parallel 2: ONE script, `--array=0-3%2`, task i running point p<i>'s run dir with
    the same body as a single job's script (same agent, same rank binding, same preemption handling)."""
    text = render_array_sbatch(sweep_points(), 2, SWEEP, f"/shared/orchestrate/sweeps/{SWEEP}")
    check_golden("sweep_array.sbatch", text)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    lines = text.splitlines()
    assert [ln for ln in lines if "--array" in ln and ln.startswith("#SBATCH")] == ["#SBATCH --array=0-3%2"]
    assert f"#SBATCH --job-name={SWEEP}" in lines
    assert f"#SBATCH --output=/shared/orchestrate/sweeps/{SWEEP}/slurm-%A_%a.out" in lines
    assert array_spec(4, 2) == "0-3%2" and array_spec(3, 8) == "0-2%3"
    single = render_sbatch(sweep_points()[0][0], cluster("slurm_local").slurm)
    body = single[single.index('mkdir -p "$RUN_DIR/logs"'):]
    assert text.endswith(body)  # the one body both scripts share
    code = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))
    assert "SLURM_NODEID" not in code and "--node-rank" not in code  # (ranks still bound in the tasks)


def test_array_task_picks_its_point(tmp_path):
    """Run the rendered array script in bash with a stand-in srun: array task 2 runs the agent on p2's run dir with
    p2's restart budget; a task past its own budget gives up (exit 3) without starting anything."""
    points = sweep_points(budgets=(3, 3, 1, 3), root=str(tmp_path / "runs"))
    script = tmp_path / "job.sbatch"
    script.write_text(render_array_sbatch(points, 2, SWEEP, str(tmp_path)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*" > "$SRUN_LOG"\n')
    (bin_dir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_ARRAY_TASK_ID="2", SLURM_JOB_ID="107",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2", SRUN_LOG=str(tmp_path / "srun.log"))
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    srun = (tmp_path / "srun.log").read_text()
    assert srun.rstrip().endswith(f"-m orchestrator.node {tmp_path}/runs/{SWEEP}-p2"), srun
    assert (tmp_path / "runs" / f"{SWEEP}-p2" / "logs").is_dir()
    assert not (tmp_path / "runs" / f"{SWEEP}-p1").exists()
    (tmp_path / "srun.log").unlink()
    r = subprocess.run(["bash", str(script)], env=dict(env, SLURM_RESTART_COUNT="2"), capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 3 and "exceeds health.max_restarts=1" in r.stderr, r.stderr
    assert not (tmp_path / "srun.log").exists()
    r = subprocess.run(["bash", str(script)], env=dict(env, SLURM_RESTART_COUNT="2", SLURM_ARRAY_TASK_ID="3"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr  # (p3's budget is 3)


def test_array_needs_points_that_agree():
    """SLURM gives every task of an array the same options: a sweep of, say, slurm.time is refused, naming the
    point and the option; pyxis points must agree on the image."""
    points = sweep_points(3)
    assert array_problems(points) == []
    plan, slurm = points[2]
    points[2] = (plan, replace(slurm, time="01:00:00"))
    problems = array_problems(points)
    assert [p.where for p in problems] == ["point p2"] and "time" in problems[0].message
    assert "'00:15:00'" in problems[0].message and "'01:00:00'" in problems[0].message
    from orchestrator.core.container import ContainerPlan
    pyxis = [(replace(pl, container=ContainerPlan(runtime="pyxis", image="img.sqsh")), sl) for pl, sl in points[:2]]
    assert array_problems(pyxis) == []
    pyxis[1] = (replace(pyxis[1][0], container=ContainerPlan(runtime="pyxis", image="other.sqsh")), pyxis[1][1])
    assert [p.where for p in array_problems(pyxis)] == ["point p1"] and "other.sqsh" in array_problems(pyxis)[0].message


def test_a_pyxis_sweep_is_one_array_whose_task_step_mounts_its_own_points_run_dir(tmp_path):
    """A sweep on a pyxis cluster: the array's task step carries the container flags, with the run dir of the task's
    own point (bound per task, not quoted away); run in bash with a stand-in srun as array task 1."""
    from orchestrator.core.container import ContainerPlan
    points = [(replace(pl, container=ContainerPlan(runtime="pyxis", image="nvcr.io/nvidia/pytorch:25.01-py3",
                                                   python="/usr/bin/python3"), package_root="/opt/pkg"), sl)
              for pl, sl in sweep_points(2, root=str(tmp_path / "runs"))]
    assert array_problems(points) == []
    script = tmp_path / "job.sbatch"
    script.write_text(render_array_sbatch(points, 2, SWEEP, str(tmp_path)))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_LOG"\n')
    (bin_dir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_ARRAY_TASK_ID="1", SLURM_JOB_ID="108",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2", SRUN_LOG=str(tmp_path / "srun.log"))
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "srun.log").read_text().splitlines()
    p1 = f"{tmp_path}/runs/{SWEEP}-p1"
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in argv, argv
    assert any(a.startswith(f"--container-mounts={p1}:{p1}:rw,") for a in argv), argv
    assert argv[-3:] == ["-m", "orchestrator.node", p1] and argv[-4] == "/usr/bin/python3", argv


def test_array_task_rendezvous_port_and_handle():
    """Tasks of one array may share nodes: task i rendezvous on launch.port + 1 + i (the agent binds it, in its
    accelerate config too); a single SLURM job without a launch.port on launch.port + 1001 + its job id % 1500 (two
    jobs SLURM gives the same node do not meet on one port); other backends keep their plan's port. A task's handle is
    slurm://<array>_<i>."""
    from orchestrator.node.agent import bind_port
    plan = fixed_plan(2)
    plan = replace(plan, node_plans=tuple(replace(n, accelerate_config=dict(n.accelerate_config,
                                                                            main_process_port=29500))
                                          for n in plan.node_plans))
    bound = bind_port(plan, {"SLURM_ARRAY_TASK_ID": "3"})
    assert bound.port == 29504 and {n.accelerate_config["main_process_port"] for n in bound.node_plans} == {29504}
    assert bind_port(plan, {}) is plan
    assert bind_port(plan, {"SLURM_JOB_ID": "123456"}) is plan  # a launch.port that was given: used as given
    auto = replace(plan, port_per_job=True)
    single = bind_port(auto, {"SLURM_JOB_ID": "123456"})
    assert single.port == 29500 + 1001 + 123456 % 1500 == 30957
    assert {n.accelerate_config["main_process_port"] for n in single.node_plans} == {30957}
    assert bind_port(auto, {"SLURM_JOB_ID": "123457"}).port == 30958  # the next job: another port
    assert bind_port(plan, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}).port == 29504
    assert bind_port(replace(plan, cluster_kind="ssh"), {"SLURM_ARRAY_TASK_ID": "3"}).port == 29500
    assert job_id_of("slurm://1234_3") == "1234_3" and job_id_of("slurm://1234") == "1234"
    with pytest.raises(ConfigError):
        job_id_of("slurm://1234_")

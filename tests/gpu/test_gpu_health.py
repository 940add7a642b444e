"""GPU health before launch (issue #26), on real sshd hosts with a stand-in nvidia-smi (tests/fakes/nvidia-smi)
reporting 2 uncorrectable ECC errors on host b's GPU 1:

- health.gpu_check: fail (the default): exit 2 before any node starts, one line naming host b, GPU 1, the field and
  its value;
- warn: the job starts and completes, the warning said (host, GPU, field);
- exclude_host with a spare listed: host b is replaced by host c before the start and the job completes on a and c;
  `status` shows b excluded and why.

The job is a user's loop that needs no GPU (tests/faults/beat_loop.py) under a GPU plan of 2 processes per host,
with the ranks' network pre-flight off (it would ask NCCL for a collective)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from helpers import cli

REPO = Path(__file__).resolve().parents[2]
BAD = {"1": {"ecc.errors.uncorrected.volatile.total": 2}}  # GPU 1: 2 uncorrectable ECC errors
FIELD = "GPU 1: ecc.errors.uncorrected.volatile.total = 2 (uncorrectable ECC errors since the driver loaded)"


def _job(tmp_path: Path, policy: str) -> Path:
    job = tmp_path / f"loop-{policy}.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(REPO / "tests" / "faults" / "beat_loop.py"), "args": ["4"]},
                                   "launch": {"nodes": 2, "procs_per_node": 2},
                                   "health": {"gpu_check": policy, "preflight_timeout": 0}}))
    return job


def test_a_bad_gpu_refuses_the_job_naming_host_gpu_and_field(gpu_testbed, gpu_hosts, tmp_path):
    a, b = gpu_testbed.hosts[:2]
    _, cluster = gpu_hosts({a: 2, b: 2}, health={b: BAD})
    home = tmp_path / "home"
    r = cli("submit", _job(tmp_path, "fail"), "--cluster", cluster, env={"ORCHESTRATE_HOME": home}, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{b}: {FIELD}" in lines[0] and a not in lines[0].replace(f"{b}:", ""), r.stderr
    run_dir = next((home / "runs").iterdir())
    assert not (run_dir / "nodes" / "0" / "agent.json").exists()  # nothing started


def test_warn_starts_the_job_and_says_so(gpu_testbed, gpu_hosts, tmp_path):
    a, b = gpu_testbed.hosts[:2]
    _, cluster = gpu_hosts({a: 2, b: 2}, health={b: BAD})
    r = cli("submit", _job(tmp_path, "warn"), "--cluster", cluster, env={"ORCHESTRATE_HOME": tmp_path / "home"},
            timeout=300)
    assert r.returncode == 0 and "COMPLETED" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"GPU health (health.gpu_check: warn): {b}: {FIELD}" in r.stderr, r.stderr


def test_exclude_host_replaces_the_bad_host_with_the_spare_before_the_start(gpu_testbed, gpu_hosts, tmp_path):
    a, b, c = gpu_testbed.hosts[:3]
    _, cluster = gpu_hosts({a: 2, b: 2, c: 2}, health={b: BAD})
    home = tmp_path / "home"
    r = cli("submit", _job(tmp_path, "exclude_host"), "--cluster", cluster, env={"ORCHESTRATE_HOME": home},
            timeout=300)
    assert r.returncode == 0 and "COMPLETED" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    run_dir = next((home / "runs").iterdir())
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [n["host"] for n in plan["node_plans"]] == [a, c]
    st = json.loads(cli("status", run_dir.name, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
    assert st["state"] == "COMPLETED" and st["restarts"] == 0, st  # replaced before the start: not a restart
    assert list(st["excluded"]) == [b] and FIELD in st["excluded"][b], st["excluded"]


def test_no_spare_for_a_bad_host_under_exclude_host_refuses(gpu_testbed, gpu_hosts, tmp_path):
    a, b = gpu_testbed.hosts[:2]
    _, cluster = gpu_hosts({a: 2, b: 2}, health={b: BAD})
    r = cli("submit", _job(tmp_path, "exclude_host"), "--cluster", cluster,
            env={"ORCHESTRATE_HOME": tmp_path / "home"}, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"no spare host left to replace {b}" in r.stderr and FIELD in r.stderr, r.stderr

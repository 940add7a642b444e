"""`orchestrate gc` on SSH hosts that share nothing with the submitter (tests/staging/conftest.py): two staged jobs
whose code roots share one file; while the second still runs, gc removes the first: its run dir on each host and the
blob only it staged go, the shared blob, the node package and everything of the running job stay; the dry run listed
exactly that. Once the second job is cancelled, gc leaves the hosts' cache empty. The host side runs as source over SSH
(orchestrator/node/hostgc.py): the hosts have no orchestrate."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import cli, wait_until
from private_hosts import host_run

REPO = Path(__file__).resolve().parents[2]
GCWORK = "/var/tmp/orchestrate-host/gcwork"  # a workdir of this test's own: no other test's runs in its cache

pytestmark = pytest.mark.slow


def _ls(tb, host: str, path: str) -> set[str]:
    r = host_run(tb, host, ["sh", "-c", f"ls -A {path} 2>/dev/null"])
    return set(r.stdout.decode().split())


def _job(tmp_path: Path, name: str, steps: int, pause: float) -> tuple[Path, bytes]:
    """A job whose code root is a directory of its own: the shared loop script and a file only it has."""
    root = tmp_path / name
    root.mkdir()
    shutil.copy(REPO / "tests" / "faults" / "beat_loop.py", root / "beat_loop.py")
    own = (f"{name} only ".encode()) * 20000 + os.urandom(64)
    (root / f"only_{name}.bin").write_bytes(own)
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"run": {"script": str(root / "beat_loop.py"), "args": [str(steps), str(pause)]},
                                   "health": {"stall_timeout": 120}}))
    return job, own


def test_gc_frees_a_finished_jobs_host_files_and_leaves_a_running_ones(private_testbed, tmp_path, job_guard):
    tb = private_testbed
    home = tmp_path / "home"
    job_guard.home(home)
    env = {"ORCHESTRATE_HOME": home}
    cluster = tmp_path / "gc-cluster.yaml"
    cluster.write_text(yaml.safe_dump(tb.cluster("privgc", workdir=GCWORK)))
    hosts = tb.hosts[:2]
    for h in hosts:
        host_run(tb, h, ["rm", "-rf", GCWORK])
    job_a, own_a = _job(tmp_path, "ja", 2, 0.01)
    job_b, own_b = _job(tmp_path, "jb", 3000, 0.05)
    sha_a, sha_b = hashlib.sha256(own_a).hexdigest(), hashlib.sha256(own_b).hexdigest()
    shared = hashlib.sha256((REPO / "tests" / "faults" / "beat_loop.py").read_bytes()).hexdigest()

    a = cli("submit", job_a, "--nodes", "2", "--cluster", cluster, env=env, timeout=300, cwd=tmp_path)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    id_a = next(line.split()[1].rstrip(":") for line in a.stdout.splitlines() if ": run dir " in line)
    b = cli("submit", job_b, "--nodes", "2", "--cluster", cluster, "--detach", env=env, timeout=300, cwd=tmp_path)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    id_b = next(w for w in b.stdout.split() if w.startswith("jb-"))
    staged = json.loads((home / "runs" / id_b / "staged.json").read_text())
    package = json.loads((home / "runs" / id_b / "plan.json").read_text())["node_package"]
    before = {h: _ls(tb, h, f"{GCWORK}/cache/blobs") for h in hosts}
    for h in hosts:
        assert {sha_a, sha_b, shared} <= before[h], (h, before[h])
        assert {id_a, id_b} <= _ls(tb, h, f"{GCWORK}/runs")

    dry = cli("gc", "--older-than", "0", "--dry-run", "--json", env=env, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    d = json.loads(dry.stdout)
    assert d["jobs"] == [id_a] and d["kept"] == {id_b: "not finished (RUNNING)"}, d
    for h in hosts:
        mine = {i["what"]: i for i in d["items"] if i["where"] == h}
        assert set(mine) == {"run dir", "cache"}, d["items"]
        assert mine["run dir"]["path"] == f"{staged['hosts'][h]['workdir']}/runs/{id_a}"
        assert mine["cache"]["bytes"] == len(own_a) and "1 trees, 1 blobs" == mine["cache"]["detail"], mine
    assert [(i["where"], i["what"]) for i in d["items"] if i["where"] == "local"] == [("local", "run dir")]
    assert all(_ls(tb, h, f"{GCWORK}/cache/blobs") == before[h] for h in hosts)  # the dry run removed nothing
    assert (home / "runs" / id_a).is_dir()

    real = cli("gc", "--older-than", "0", "--json", env=env, timeout=120)
    assert real.returncode == 0, real.stdout + real.stderr
    r = json.loads(real.stdout)
    assert r["items"] == d["items"] and r["jobs"] == [id_a], (d["items"], r["items"])
    for h in hosts:
        blobs = _ls(tb, h, f"{GCWORK}/cache/blobs")
        assert blobs == before[h] - {sha_a, sha_a + ".ok"}, (h, before[h] - blobs)
        assert {shared, sha_b} <= blobs and package in _ls(tb, h, f"{GCWORK}/cache/trees")
        assert _ls(tb, h, f"{GCWORK}/runs") == {id_b}
    assert not (home / "runs" / id_a).exists() and (home / "runs" / id_b).is_dir()
    st = cli("status", id_b, "--json", env=env, timeout=60)
    assert json.loads(st.stdout)["state"] == "RUNNING", st.stdout  # the running job never noticed

    c = cli("cancel", id_b, env=env, timeout=120)
    assert c.returncode == 0 and "CANCELLED" in c.stdout, c.stdout + c.stderr
    wait_until(lambda: not (home / "supervisors" / f"{id_b}.pid").exists(), 30, what="the supervisor to end")
    last = cli("gc", "--older-than", "0", "--json", env=env, timeout=120)
    assert last.returncode == 0 and json.loads(last.stdout)["jobs"] == [id_b], last.stdout + last.stderr
    for h in hosts:  # nothing of either job is left on the hosts: runs, trees, blobs (the node package's too)
        assert _ls(tb, h, f"{GCWORK}/runs") == set()
        assert _ls(tb, h, f"{GCWORK}/cache/trees") == set() and _ls(tb, h, f"{GCWORK}/cache/blobs") == set()
    assert cli("ls", "--json", env=env).stdout.strip() == "[]"

"""A sweep over real sshd hosts (#37 item 11): two points on the same two hosts run one after the other through the
hosts' leases (the second QUEUED, naming the first as the holder), both COMPLETED, per host the agents' intervals
never overlap; `sweep`, `status SWEEP_ID` know the points."""

from __future__ import annotations

import json
import os
import subprocess
import time

import yaml

from helpers import OFFLINE_ENV, PYTHON, cli
from ssh_helpers import REPO, remote_run_dir
from test_ssh_leases import _cluster, _interval, _port, _short_job


def test_a_two_point_sweep_on_the_same_hosts_queues_one_point_behind_the_other(testbed, tmp_path, job_guard):
    a, b = testbed.hosts[:2]
    home = job_guard.home(tmp_path / "home")
    job = _short_job(tmp_path, 1)  # (its args a mapping: the sweep gives each point its own output_dir)
    job.write_text(yaml.safe_dump({"run": {"script": yaml.safe_load(job.read_text())["run"]["script"],
                                           "args": {"output_dir": str(tmp_path / "out"), "point": -1}}}))
    cluster = _cluster(testbed, tmp_path, "pool", [a, b])
    env = {**os.environ, **OFFLINE_ENV, "ORCHESTRATE_HOME": str(home)}
    t0 = time.monotonic()
    p = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2", "--cluster",
                         str(cluster), _port(), "--sweep", "run.args.point=0..1", "--max-parallel", "2"],
                        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.communicate(timeout=180)[0]
    took = time.monotonic() - t0
    assert p.returncode == 0, out[-4000:]
    sid = next(line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("sweep sweep-"))
    doc = json.loads((home / "sweeps" / f"{sid}.json").read_text())
    ids = [pt["job_id"] for pt in doc["points"]]
    queued = [line for line in out.splitlines() if "QUEUED" in line]
    assert queued and any(f"is leased by job {ids[0]}" in q or f"is leased by job {ids[1]}" in q for q in queued), out
    for jid in ids:
        st = json.loads(cli("status", jid, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
        assert st["state"] == "COMPLETED", st
    for rank, host in enumerate((a, b)):
        spans = sorted(_interval(remote_run_dir(testbed, host, jid), rank) for jid in ids)
        assert spans[0][1] <= spans[1][0], (host, spans)  # one point after the other on each host
    table = json.loads(cli("sweep", sid, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
    assert [r["state"] for r in table["points"]] == ["COMPLETED"] * 2, table
    print(f"SSH sweep: 2 points on {a},{b}, serialized by the leases: {took:.1f} s")

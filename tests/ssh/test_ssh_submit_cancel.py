"""Ctrl-C while an SSH submit is still starting the job (staging, connecting, the hosts' pre-flight): the submit stops
within a poll instead of waiting out a silent host's timeout, nothing of the job is left on any host (the healthy
host's staging server stands down), the store says CANCELLED and the CLI exits 130."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest
import yaml

from helpers import PYTHON, cli, processes

SILENT_TIMEOUT_S = 30  # the silent host would hold the pre-flight this long without the cancel


def _job_processes(job: str, workdir: str) -> list[int]:
    """Processes that are the job's: its node agents (their command line names the job) or the healthy host's
    staging server (`python -c ... serve WORKDIR`)."""
    j, w = job.encode(), workdir.encode()
    return processes(lambda cmd: (j in cmd and b"orchestrator.node" in cmd) or (b"\0serve\0" in cmd and w in cmd))


@pytest.mark.fault
def test_ctrl_c_during_the_preflight_stops_at_once_and_leaves_nothing(testbed, tmp_path, job_guard):
    silent_ip = testbed.hosts[0].rsplit(".", 1)[0] + ".250"  # accepts TCP on the SSH port, never sends a banner
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind((silent_ip, testbed.port))
    silent.listen(8)
    try:
        spec = testbed.cluster(hosts=[testbed.hosts[0], silent_ip], connect_timeout=SILENT_TIMEOUT_S)
        block = spec["ssh"]
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(yaml.safe_dump(spec))
        script = tmp_path / "train.py"
        script.write_text("print('never runs')\n")
        job_file = tmp_path / "job.yaml"
        job_file.write_text(yaml.safe_dump({"run": {"script": str(script)}}))
        home = job_guard.home(tmp_path / "home")
        env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
        proc = job_guard.spawn([PYTHON, "-m", "orchestrator.cli", "submit", str(job_file), "--nodes", "2",
                                "--cluster", str(cluster)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        lines, job = [], None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("job ") and ": run dir " in line:
                job = line.split()[1].rstrip(":")
                break
        assert job, "".join(lines) + proc.communicate(timeout=60)[0]
        workdir = block["workdir"].replace("{host}", testbed.hosts[0])
        deadline = time.monotonic() + 30
        while not _job_processes(job, workdir) and time.monotonic() < deadline:  # the healthy host is being staged
            time.sleep(0.05)
        assert _job_processes(job, workdir), "the healthy host was never reached"
        time.sleep(0.5)
        assert proc.poll() is None, "".join(lines) + proc.communicate()[0]  # still held by the silent host
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out = "".join(lines) + proc.communicate(timeout=SILENT_TIMEOUT_S + 30)[0]
        took = time.monotonic() - t0
        print(f"Ctrl-C during the pre-flight -> exit {proc.returncode} after {took:.2f} s")
        assert proc.returncode == 130, out
        assert took < 5.0, f"the submit waited {took:.1f} s for the silent host after Ctrl-C:\n{out}"
        assert f"job {job} CANCELLED" in out and "Ctrl-C" in out, out
        deadline = time.monotonic() + 5
        while _job_processes(job, workdir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _job_processes(job, workdir), "the healthy host's staging server or agent did not stand down"
        st = cli("status", job, "--json", env={"ORCHESTRATE_HOME": str(home)}, timeout=60)
        assert json.loads(st.stdout)["state"] == "CANCELLED", st.stdout + st.stderr
    finally:
        silent.close()


def test_ls_asks_the_backends_of_unsupervised_jobs_at_once(testbed, tmp_path):
    """Three SSH jobs recorded RUNNING whose supervisors are gone (as after a SIGKILLed `submit --detach`) and whose
    host went silent: `orchestrate ls` asks the three backends at once, so it costs one connect timeout, not three,
    and the store keeps them RUNNING (a host that cannot be asked proves nothing)."""
    from orchestrator.core.spec import cluster_to_dict, parse_cluster
    from orchestrator.node.rundir import RunDir
    from orchestrator.store import JobStore

    timeout_s = 8.0  # one at a time would take 3 x 8 s; at once, 8 s plus the CLI's start-up
    silent_ip = testbed.hosts[0].rsplit(".", 1)[0] + ".251"
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind((silent_ip, testbed.port))
    silent.listen(8)
    try:
        cluster = parse_cluster(testbed.cluster(hosts=[silent_ip], connect_timeout=timeout_s))
        home = tmp_path / "home"
        home.mkdir()
        store = JobStore(home / "jobs.db")
        jobs = [f"gone-{i}" for i in range(3)]
        for job in jobs:
            rd = RunDir(home / "runs" / job)
            rd.root.mkdir(parents=True)
            rd.write_json(RunDir.CLUSTER, cluster_to_dict(cluster))
            rd.write_json(RunDir.HANDLE, {"uri": f"ssh://{job}", "data": {"job_id": job, "nodes": [
                {"rank": 0, "host": silent_ip, "run_dir": f"/nonexistent/{job}", "wrapper_pid": None,
                 "prefix": []}]}})
            store.create(job_id=job, recipe="job.yaml", recipe_digest="0", cluster="testlab", backend="ssh", nodes=1,
                         world_size=1, run_dir=str(rd.root))
            store.update(job, "RUNNING", handle=f"ssh://{job}")
        t0 = time.monotonic()
        r = cli("ls", "--json", env={"ORCHESTRATE_HOME": str(home)}, timeout=120)
        took = time.monotonic() - t0
        print(f"ls with 3 unsupervised jobs on a silent host (connect timeout {timeout_s:g} s): {took:.2f} s")
        assert r.returncode == 0, r.stdout + r.stderr
        rows = {row["id"]: row for row in json.loads(r.stdout)}
        assert {rows[j]["state"] for j in jobs} == {"RUNNING"}, rows
        assert timeout_s <= took < 2 * timeout_s, f"ls took {took:.1f} s: the backends were asked one by one"
    finally:
        silent.close()

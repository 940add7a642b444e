"""The public Python API on real sshd hosts (issue #36): a 2-host job submitted from Python with a cluster file,
waited for; its status names both SSH hosts, its logs carry each host's lines, `result()` reads rank 0's last
heartbeat, and the supervisor that ran it is gone."""

from __future__ import annotations

import time

import pytest
import yaml

import orchestrator
from helpers import wait_until


@pytest.mark.slow
def test_a_two_host_job_through_the_api(testbed, tmp_path, monkeypatch, job_guard):
    from orchestrator.api import free_port
    from orchestrator.detach import live_supervisor
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(testbed.cluster()))
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('HELLO rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], "
                      "flush=True)\n")
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    job = orchestrator.submit({"name": "api-ssh", "run": {"script": str(script)}}, nodes=2, cluster=cluster,
                              overrides={"launch.port": free_port()})
    st = job.wait(timeout=300, raise_on_failure=True)
    took = time.monotonic() - t0
    assert st.state == "COMPLETED" and st.backend == "ssh", st
    assert [(n.node, n.host, n.end) for n in st.nodes] == [(0, testbed.hosts[0], "done"),
                                                         (1, testbed.hosts[1], "done")], st.nodes
    said = sorted(x for x in job.logs() if " HELLO " in x)
    assert said == [f"[{testbed.hosts[0]} node0 rank0] HELLO rank 0 of 2",
                    f"[{testbed.hosts[1]} node1 rank1] HELLO rank 1 of 2"], said
    assert job.result().state == "COMPLETED"
    wait_until(lambda: live_supervisor(job.id) is None, 30, 0.2, "the job's supervisor to end")
    print(f"SSH job through the API: submit -> COMPLETED in {took:.1f}s")

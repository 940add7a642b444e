"""The fault suite on SSH hosts that share NOTHING with the submitter (issue #13): the same three faults as
test_faults.py (a rank SIGKILLed, SIGSTOPped, calling sys.exit(3)), the probe shipped as your own code (`run:
{script: fault_probe.py}`: staged with its repository, the node package shipped, no orchestrate on the hosts), on
private mount-namespace sshd hosts (tests/private_hosts.py). Same end state and root-cause text as on every
other backend, nothing left behind, everything owner-only, the stopped rank's stack kept on its host."""

from __future__ import annotations

import json
import time

import pytest
import yaml

import jobrun
from helpers import wait_gone, wait_until
from orchestrator import api
from orchestrator.node.proctools import marked
from orchestrator.node.rundir import RunDir
from private_hosts import host_path, private_down, private_up
from test_faults import EXPECTED, PROBE, STALL, inject_and_judge

WORK = "/var/tmp/orchestrate-host/work"

pytestmark = [pytest.mark.ssh, pytest.mark.health]


@pytest.fixture(scope="module")
def fault_private(tmp_path_factory):
    tb = private_up(2, tmp_path_factory.mktemp("fault-private"), "127.0.12.20", 2231,
                    hide=[tmp_path_factory.getbasetemp()])
    yield tb
    private_down(tb)


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_same_fault_same_verdict_on_hosts_that_share_nothing(fault, fault_private, tmp_path, job_guard):
    tb = fault_private
    out = tmp_path / "outputs" / "faults"  # the job's output dir: ${RUN_DIR}/output on each host
    job = tmp_path / "faults.yaml"
    job.write_text(yaml.safe_dump({
        "run": {"script": str(PROBE), "args": [str(out), "exit:1:3" if fault == "exit3" else "loop"]},
        "health": {"stall_timeout": STALL, "startup_timeout": 120, "poll_interval": 0.5, "max_restarts": 0}}))
    cluster = tmp_path / "private.yaml"
    cluster.write_text(yaml.safe_dump(tb.cluster("privlab")))
    prep = api.prepare(str(job), str(cluster), nodes=2, cwd=tmp_path, check_trainer=False)
    assert "${RUN_DIR}/staged/code/tests/faults/fault_probe.py" in prep.plan.node(0).command
    rd = RunDir(prep.plan.run_dir)
    api.write_files(prep.files, rd.root)
    job_guard.run_dir(rd.root)
    from launchers import launcher_for
    t0 = time.monotonic()
    running = jobrun.start(launcher_for(prep.cluster), prep.plan, rd.root)
    key = json.loads(prep.files["stage.json"])["output_key"]  # (${RUN_DIR}/output links there on the host)
    pid1 = host_path(tb, tb.hosts[1], f"{WORK}/{key}/pid1")
    wait_until(lambda: pid1.exists() and rd.furthest_step() and rd.furthest_step() >= 3, 180, 0.1,
               "both ranks stepping")
    res, took, tokens = inject_and_judge(fault, int(pid1.read_text()), running, rd, job_guard, list(tb.hosts),
                                         f"private/{fault}", t0)
    gone = wait_gone(lambda: [p for t in tokens if t for p in marked(t)], 20)
    print(f"private/{fault}: every process of the job gone {gone:.2f}s after the verdict")
    for host in tb.hosts[:2]:  # everything orchestrate made on the host is owner-only
        root = host_path(tb, host, WORK)  # (made by the testbed; what is in it, by orchestrate)
        loose = [f"{p} {oct(p.lstat().st_mode & 0o777)}" for p in root.rglob("*")
                 if not p.is_symlink() and p.lstat().st_mode & 0o077]
        assert not loose, f"{host}: not owner-only: " + ", ".join(loose[:10])
    if fault == "sigstop":  # the stopped rank's stack is kept on the host that ran it
        stacks = host_path(tb, tb.hosts[1], f"{WORK}/runs/{prep.plan.job_id}/stacks/rank1.txt")
        assert stacks.exists(), stacks

"""A host whose network goes away (all its traffic dropped with nftables, in a table of this test's own, on this
test's loopback address only): it is named as unreachable (not "rank N hung") within seconds in every phase, the
healthy host is torn down at once, the submitter never blocks on the dead link, no library noise reaches the
terminal; once the link is back, the cut-off host's processes end by themselves (their controlling connection is
gone)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

import jobrun
from ssh_helpers import agent_info, live_members
from ssh_helpers import wait_gone as wait_groups_gone  # groups and job tokens

PRINTER = ("sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done")


def _nft(*args: str) -> None:
    subprocess.run(["nft", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def cut_off():
    """cut_off(host): drop every packet to or from `host` (a loopback address of the testbed); undone at the end."""
    if shutil.which("nft") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("nft (nftables) missing under CI: scripts/install_ssh_deps.sh installs it")
        pytest.skip("nft (nftables) not installed")
    table = f"orch_cut_{os.getpid()}"
    made = []

    def cut(host: str) -> None:
        if not made:
            _nft("add", "table", "ip", table)
            _nft("add", "chain", "ip", table, "input", "{ type filter hook input priority 0 ; }")
            made.append(table)
        _nft("add", "rule", "ip", table, "input", "ip", "saddr", host, "drop")
        _nft("add", "rule", "ip", table, "input", "ip", "daddr", host, "drop")

    def restore() -> None:
        if made:
            subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True, timeout=30)
            made.clear()
    cut.restore = restore
    yield cut
    restore()


@pytest.mark.fault
@pytest.mark.parametrize("phase", ["running", "start-up"])
def test_unreachable_host_is_named_and_the_rest_torn_down_at_once(testbed, trivial_job, cut_off, phase, capfd):
    cmd = PRINTER if phase == "running" else ("sh", "-c", "sleep 600")  # start-up: no output, no step ever
    launcher, sub, _, plan = trivial_job({0: cmd, 1: cmd}, tag=f"cut{phase[:3]}")
    job = jobrun.start(launcher, plan, submission=sub)
    a = [agent_info(testbed, testbed.hosts[r], plan.job_id, r) for r in (0, 1)]
    healthy = [a[0]["agent_pgid"], a[0]["pgid"], a[0]["token"]]
    cut_host = [a[1]["agent_pgid"], a[1]["pgid"], a[1]["token"]]
    time.sleep(1.0)
    t0 = time.monotonic()
    cut_off(testbed.hosts[1])
    res = job.result(60)
    took = time.monotonic() - t0
    healthy_gone = wait_groups_gone(healthy, timeout=10) + took
    print(f"{phase}: host cut off -> {res.state} after {took:.1f}s, healthy node gone {healthy_gone:.1f}s after the "
          f"cut: {res.root_cause}")
    assert res.state == "FAILED", res
    assert f"host {testbed.hosts[1]} stopped answering" in res.root_cause, res.root_cause
    assert "hung" not in res.root_cause
    assert took < 15, took
    assert healthy_gone < 20
    err = capfd.readouterr().err
    assert "unrequested channel" not in err and "paramiko" not in err.lower(), err[-2000:]
    assert live_members(cut_host), "the cut-off host's processes cannot have heard anything yet"
    cut_off.restore()
    left = wait_groups_gone(cut_host, timeout=30)
    print(f"{phase}: link back -> the cut-off host's processes gone {left:.1f}s later")

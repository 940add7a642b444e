"""A host whose network goes away (all its traffic dropped with nftables, in a table of this test's own, on this
test's loopback address only): it is named as unreachable (not "rank N hung") within seconds in every phase, the
healthy host is torn down at once, the submitter never blocks on the dead link, no library noise reaches the
terminal; once the link is back, the cut-off host's processes end by themselves (their controlling connection is
gone)."""

from __future__ import annotations

import time

import pytest

import jobrun
from ssh_helpers import agent_info, live_members
from ssh_helpers import wait_gone as wait_groups_gone  # groups and job tokens

PRINTER = ("sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done")


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

"""Fixtures of the staging suite: SSH hosts that share NOTHING with the submit host (scripts/sshd_hosts.py
private hosts: each sshd in a mount namespace of its own, the test venv read-only at /opt/hostenv, the checkout,
/tmp and the submitter's caches hidden, a private tmpfs work area at /var/tmp/orchestrate-host).

Needs root, Debian's openssh-server and util-linux (unshare, nsenter). Without them the tests skip with the
reason, except under CI=true, where a missing prerequisite is a failure (as in tests/ssh/conftest.py).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import sshd_hosts  # noqa: E402
from private_hosts import host_read_bytes, private_down, private_up  # noqa: E402

BASE_IP = os.environ.get("ORCHESTRATE_TEST_PRIVATE_BASE_IP", sshd_hosts.PRIVATE_BASE_IP)  # 127.0.13.2
PORT = int(os.environ.get("ORCHESTRATE_TEST_PRIVATE_PORT", str(sshd_hosts.PRIVATE_PORT)))  # 2224
N_HOSTS = 3  # 2 job nodes + 1 spare
WORK = f"{sshd_hosts.HOST_WORK_AREA}/work"


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.ssh)


@pytest.fixture(scope="session")
def private_testbed(tmp_path_factory):
    """3 private hosts (127.0.13.2-4, port 2224); ssh_block(): python /opt/hostenv/bin/python,
    workdir /var/tmp/orchestrate-host/work, shared_fs false."""
    tb = private_up(N_HOSTS, tmp_path_factory.mktemp("sshd_private"), BASE_IP, PORT,
                    hide=[tmp_path_factory.getbasetemp()])
    yield tb
    private_down(tb)


@pytest.fixture
def make_private_cluster(private_testbed):
    """make_private_cluster(hosts=None, **ssh_overrides) -> ClusterSpec (kind ssh) on the private hosts;
    hosts default to the first two."""
    from orchestrator.core.spec import parse_cluster

    def make(hosts=None, **over):
        return parse_cluster(private_testbed.cluster("privlab", hosts=hosts, **over), source="<test>")
    return make




@pytest.fixture
def stage_files(private_testbed):
    """stage_files(src) -> (stager, tree, {host: HostStage}, push seconds): the files of directory `src` staged to
    all 3 private hosts with the engine itself (launchers.ssh.stage: hello, push, close), then every host's staged
    tree checked byte by byte against the local hashes."""
    from launchers.ssh import stage as st
    from launchers.ssh.transport import Pool
    from orchestrator.core.spec import parse_cluster
    tb = private_testbed

    def stage(src: Path):
        cluster = parse_cluster({"kind": "ssh", "accelerator": "cpu", "ssh": tb.ssh_block(hosts=tb.hosts)},
                                source="<t>")
        tree = st.make_tree("data", src, st.list_root(src), st.HashCache(None))
        pool = Pool(cluster.ssh)
        try:
            s = st.Stager(pool, cluster.ssh, [tree], {}, ())
            s.hello(list(tb.hosts))
            t0 = time.monotonic()
            facts = s.push()
            took = time.monotonic() - t0
            s.close()
        finally:
            pool.close()
        for h in tb.hosts:
            for rel, sha, _size, _mode in tree.entries:
                got = hashlib.sha256(host_read_bytes(tb, h, f"{WORK}/cache/trees/{tree.sha}/{rel}")).hexdigest()
                assert got == sha, (h, rel)
        return s, tree, facts, took
    return stage

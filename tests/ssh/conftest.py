"""Fixtures of the SSH suite: real sshd hosts on loopback (scripts/sshd_hosts.py), clusters and run dirs.

`testbed` is the shared-filesystem testbed (the hosts see the submitter's files and its interpreter). A test
marked `fault` runs twice: on it and on a private testbed (`private_ssh_testbed`: hosts that share nothing with
the submitter, orchestrate not installed there; the node package and the job are staged), ids `[shared]` /
`[private]`. Helpers that look at a host's files (ssh_helpers.remote_run_dir) see each host's own
view either way.

The testbed needs root and Debian's openssh-server. Without them the tests skip with the reason,
except under CI=true, where a missing prerequisite is a failure (the suite must not silently shrink).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import sshd_hosts  # noqa: E402

BASE_IP = os.environ.get("ORCHESTRATE_TEST_SSH_BASE_IP", "127.0.10.2")
PORT = int(os.environ.get("ORCHESTRATE_TEST_SSH_PORT", "2222"))
N_HOSTS = 3  # 2 job nodes + 1 spare (bad-input tests)
PRIVATE_BASE_IP = os.environ.get("ORCHESTRATE_TEST_SSH_PRIVATE_BASE_IP", "127.0.13.50")
PRIVATE_PORT = int(os.environ.get("ORCHESTRATE_TEST_SSH_PRIVATE_PORT", "2232"))


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.ssh)


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"SSH testbed prerequisite missing under CI: {reason}", pytrace=False)
    pytest.skip(f"SSH testbed unavailable: {reason}")


def pytest_generate_tests(metafunc):
    if "testbed" in metafunc.fixturenames and metafunc.definition.get_closest_marker("fault"):
        metafunc.parametrize("testbed", ["shared", "private"], indirect=True)


@pytest.fixture(scope="session")
def testbed(request):
    """The shared-filesystem testbed, or (a `fault` test's [private] run) the private one."""
    return request.getfixturevalue("private_ssh_testbed" if getattr(request, "param", "shared") == "private"
                                   else "shared_testbed")


@pytest.fixture(scope="session")
def private_ssh_testbed(tmp_path_factory):
    """3 hosts that share nothing with the submitter (tests/private_hosts.py), the SSH suite's own (127.0.13.50-52,
    port 2232): tests/staging's private hosts stay as fresh as its tests expect."""
    from private_hosts import private_down, private_up
    tb = private_up(N_HOSTS, tmp_path_factory.mktemp("sshd_private_faults"), PRIVATE_BASE_IP, PRIVATE_PORT,
                    hide=[tmp_path_factory.getbasetemp()])
    yield tb
    private_down(tb)


@pytest.fixture(scope="session")
def shared_testbed(tmp_path_factory):
    why = sshd_hosts.prerequisites()
    if why:
        _unavailable(why)
    d = tmp_path_factory.mktemp("sshd")
    try:
        tb = sshd_hosts.up(N_HOSTS, d, base_ip=BASE_IP, port=PORT)
    except RuntimeError as e:
        _unavailable(str(e))
    yield tb
    sshd_hosts.down(d)


@pytest.fixture
def make_cluster(testbed):
    """make_cluster(hosts=None, **ssh_overrides) -> ClusterSpec validated by orchestrator.core.spec."""
    from orchestrator.core.spec import parse_cluster

    def make(hosts=None, **over):
        return parse_cluster(testbed.cluster(hosts=hosts, **over), source="<test>")
    return make


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


def job_id(tag: str) -> str:
    return f"t-{tag}-{secrets.token_hex(3)}"


_BASE: dict = {}


def _base_prepared(testbed, tmp_dir: Path):
    """One real prepared SFT plan per kind of testbed (cached): its accelerate configs / recipe are reused by trivial
    jobs. On private hosts it is prepared for them: its node package (the agent is shipped, not installed there)
    and its stage.json (what the job stages)."""
    from orchestrator import api
    key = "private" if testbed.private else "shared"
    if key not in _BASE:
        cluster = None
        if testbed.private:
            cluster = tmp_dir / "private-cluster.yaml"
            cluster.write_text(json.dumps(testbed.cluster(hosts=testbed.hosts)))
        _BASE[key] = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), cluster and str(cluster), nodes=1,
                                 check_trainer=False, cwd=REPO)
    return _BASE[key]


@pytest.fixture
def trivial_job(testbed, make_cluster, tmp_path):
    """trivial_job(commands={rank: argv}, env={rank: {...}}, secret_env=(), hosts=None, **ssh_over)
    -> (launcher, submission, local_run_dir, plan): a plan whose nodes run `argv` under the real agent."""
    from launchers.ssh.launcher import SSHLauncher
    from orchestrator.core.jobplan import NodePlan
    from orchestrator.core.render import render_files

    def make(commands, env=None, secret_env=(), hosts=None, tag="job", port=29500, nodes=None, **over):
        cluster = make_cluster(hosts=hosts, **over)
        base = _base_prepared(testbed, tmp_path)
        jid = job_id(tag)
        local = tmp_path / "local" / jid
        n = nodes if nodes is not None else len(commands)
        node_hosts = list(cluster.ssh.hosts) + [""] * max(0, n - len(cluster.ssh.hosts))
        nps = tuple(NodePlan(node_rank=r, host=node_hosts[r], ranks=(r,),
                             accelerate_config=dict(base.plan.node_plans[0].accelerate_config),
                             command=tuple(commands.get(r, ("true",))), env=dict((env or {}).get(r, {})))
                    for r in range(n))
        plan = dataclasses.replace(base.plan, job_id=jid, cluster_kind="ssh", cluster_name="testlab", nodes=n,
                                   world_size=n, main_host=node_hosts[0], port=port, run_dir=str(local),
                                   secret_env=tuple(secret_env), node_plans=nps)
        files = render_files(plan, base.recipe.to_dict())
        if base.plan.node_package:  # private hosts: what the agent stages, from the base plan
            files["stage.json"] = base.files["stage.json"]
        for rel, text in files.items():
            p = local / rel
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            p.write_text(text)
        launcher = SSHLauncher(cluster, grace_s=1.0)
        return launcher, launcher.prepare(plan), local, plan
    return make


from ssh_helpers import agent_info, live_members, remote_run_dir, wait_gone  # noqa: E402,F401

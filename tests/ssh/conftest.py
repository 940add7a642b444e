"""Fixtures of the SSH suite: real sshd hosts on loopback (scripts/sshd_hosts.py), clusters and run dirs.

The testbed needs root and Debian's openssh-server. Without them the tests skip with the reason,
except under CI=true, where a missing prerequisite is a failure (the suite must not silently shrink).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import sshd_hosts  # noqa: E402

BASE_IP = os.environ.get("ORCHESTRATE_TEST_SSH_BASE_IP", "127.0.10.2")
PORT = int(os.environ.get("ORCHESTRATE_TEST_SSH_PORT", "2222"))
N_HOSTS = 3  # 2 job nodes + 1 spare (bad-input tests)


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.ssh)


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"SSH testbed prerequisite missing under CI: {reason}", pytrace=False)
    pytest.skip(f"SSH testbed unavailable: {reason}")


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
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
        block = testbed.ssh_block(**over)
        block["hosts"] = list(hosts if hosts is not None else testbed.hosts[:2])
        return parse_cluster({"kind": "ssh", "name": "testlab", "accelerator": "cpu", "network_interface": "lo",
                              "ssh": block}, source="<test>")
    return make


def job_id(tag: str) -> str:
    return f"t-{tag}-{secrets.token_hex(3)}"


_BASE: dict = {}


def _base_prepared(cluster):
    """One real prepared SFT plan (cached): its accelerate configs / recipe are reused by trivial jobs."""
    from orchestrator import api
    if "p" not in _BASE:
        _BASE["p"] = api.prepare(str(REPO / "recipes/configs/sft_tiny.yaml"), None, nodes=1, check_trainer=False,
                                 cwd=REPO)
    return _BASE["p"]


@pytest.fixture
def trivial_job(testbed, make_cluster, tmp_path):
    """trivial_job(commands={rank: argv}, env={rank: {...}}, secret_env=(), hosts=None, **ssh_over)
    -> (launcher, submission, local_run_dir, plan): a plan whose nodes run `argv` under the real agent."""
    from orchestrator.launchers.ssh.launcher import SSHLauncher
    from orchestrator.core.jobplan import NodePlan
    from orchestrator.core.render import render_files

    def make(commands, env=None, secret_env=(), hosts=None, tag="job", port=29500, nodes=None, **over):
        cluster = make_cluster(hosts=hosts, **over)
        base = _base_prepared(cluster)
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
        for rel, text in files.items():
            p = local / rel
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            p.write_text(text)
        launcher = SSHLauncher(cluster, grace_s=1.0)
        return launcher, launcher.prepare(plan), local, plan
    return make


from ssh_helpers import agent_info, live_members, remote_run_dir, wait_gone  # noqa: E402,F401

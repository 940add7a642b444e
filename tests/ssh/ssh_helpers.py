"""Plain helpers of the SSH suite (imported by the tests and conftest under a unique module name, so that
another suite's conftest can never shadow them)."""

from __future__ import annotations

from pathlib import Path

from helpers import agents, wait_until
from helpers import wait_gone as _wait_gone

REPO = Path(__file__).resolve().parents[2]


def remote_run_dir(testbed, host: str, jid: str) -> Path:
    """The run dir of job `jid` on `host`, as reachable from here: in the testbed dir (shared filesystem), or in the
    host's own mount namespace through /proc/<its sshd>/root (private hosts)."""
    if testbed.private:
        from private_hosts import host_path
        return host_path(testbed, host, f"{testbed.ssh_block()['workdir']}/runs/{jid}")
    return Path(testbed.dir) / "work" / host / "runs" / jid


def agent_info(testbed, host: str, jid: str, rank: int, timeout: float = 20.0) -> dict:
    """nodes/<rank>/agent.json of `jid` in `host`'s run dir, once the agent has written it."""
    return wait_until(lambda: agents(remote_run_dir(testbed, host, jid), rank).get(rank), timeout, 0.05,
                      f"agent.json of node {rank} on {host}")


def live_members(pgids) -> list[int]:
    """Non-zombie processes of the given process groups (ints) and of the given job markers (str tokens from
    agent.json: torchrun starts every rank in a session of its own, so groups alone would miss the ranks).
    All 'hosts' are this machine."""
    from orchestrator.node.proctools import group_members, marked
    return sorted({pid for g in pgids for pid in (marked(g) if isinstance(g, str) else group_members(int(g)))})


def wait_gone(pgids, timeout: float = 15.0) -> float:
    """Seconds until every process of the groups / markers is gone (zombies count as gone); fails on timeout.
    (helpers.wait_gone over `live_members`: groups and tokens, where helpers.wait_gone takes pids.)"""
    return _wait_gone(lambda: live_members(pgids), timeout)

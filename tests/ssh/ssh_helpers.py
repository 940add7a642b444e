"""Plain helpers of the SSH suite (imported by the tests and conftest under a unique module name, so that
another suite's conftest can never shadow them)."""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def remote_run_dir(testbed, host: str, jid: str) -> Path:
    return Path(testbed.dir) / "work" / host / "runs" / jid


def agent_info(testbed, host: str, jid: str, rank: int, timeout: float = 20.0) -> dict:
    p = remote_run_dir(testbed, host, jid) / "nodes" / str(rank) / "agent.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"no agent.json for node {rank} on {host}")


def live_members(pgids) -> list[int]:
    """Non-zombie processes of the given process groups (ints) and of the given job markers (str tokens from
    agent.json: torchrun starts every rank in a session of its own, so groups alone would miss the ranks).
    All 'hosts' are this machine."""
    from orchestrator.node.proctools import group_members, marked
    return sorted({pid for g in pgids for pid in (marked(g) if isinstance(g, str) else group_members(int(g)))})


def wait_gone(pgids, timeout: float = 15.0) -> float:
    """Seconds until every process of the groups is gone (zombies count as gone); fails on timeout."""
    t0 = time.monotonic()
    while live_members(pgids):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"processes left after {timeout}s: {live_members(pgids)}")
        time.sleep(0.02)
    return time.monotonic() - t0

"""Bounded resources of issue #29: the submitting process's open-files limit for a big job, and a node agent's
heartbeat tail reading only its own ranks' files in a shared directory."""

from __future__ import annotations

import json

import pytest

from launchers.base import ensure_open_files
from orchestrator.errors import PreflightError
from orchestrator.node.heartbeat import HeartbeatTail


def test_open_files_limit_is_raised_for_a_big_job_or_refused_with_the_numbers():
    assert ensure_open_files(256, "an SSH job", limit=(1024, 4096)) == ""  # 3 x 256 + 64 = 832 fit
    said = ensure_open_files(1024, "an SSH job", limit=(1024, 1 << 20))
    assert "from 1024 to 3136" in said and "1024 nodes" in said
    with pytest.raises(PreflightError, match=r"1024 nodes needs about 3136 open files .* limit is 1024 \(hard limit "
                                             r"2048\): raise it \(`ulimit -n 3136`"):
        ensure_open_files(1024, "an SSH job", limit=(1024, 2048))


def test_a_node_agents_tail_reads_its_own_ranks_only(tmp_path):
    for g in range(64):
        (tmp_path / f"rank{g}.jsonl").write_text(json.dumps({"rank": g, "event": "step", "step": 1}) + "\n")
    tail = HeartbeatTail(tmp_path, {8, 9, 10})
    assert [p.name for p in tail.paths()] == ["rank8.jsonl", "rank9.jsonl", "rank10.jsonl"]
    assert sorted(r["rank"] for r in tail.read()) == [8, 9, 10]
    (tmp_path / "rank9.jsonl").open("a").write(json.dumps({"rank": 9, "event": "step", "step": 2}) + "\n")
    assert [(r["rank"], r["step"]) for r in tail.read()] == [(9, 2)]
    assert len(HeartbeatTail(tmp_path).read()) == 65  # no ranks given: every file there is
    assert HeartbeatTail(tmp_path / "none", {1}).read() == []

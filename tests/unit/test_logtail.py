"""`orchestrate logs` / `attach` output: node log lines prefixed `[host nodeR]`, filtered by node, rank and regular
expression, heartbeat lines and partial lines held back."""

from __future__ import annotations

import json

from orchestrator.cli.logtail import LogTail, log_filter


def test_log_filter():
    keep = log_filter(None, 3, None, procs_per_node=2)  # rank 3 lives on node 1 with rank 2
    assert keep(1, "[rank3] loss 1.0") and keep(1, "NCCL INFO ...") and not keep(1, "[rank2] loss 1.0")
    assert not keep(0, "[rank3] loss 1.0")
    keep = log_filter(0, None, r"loss \d", procs_per_node=2)
    assert keep(0, "[rank1] loss 2") and not keep(0, "[rank1] step 2") and not keep(1, "loss 2")
    assert all(log_filter(None, None, None)(n, "x") for n in (0, 5))


def test_log_tail_prefixes_filters_and_waits_for_whole_lines(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "plan.json").write_text(json.dumps({"procs_per_node": 2, "node_plans": [
        {"node_rank": 0, "host": "gpu01"}, {"node_rank": 1, "host": ""}]}))
    (tmp_path / "logs" / "node0.log").write_text("[rank0] a\nORCHESTRATE_HB {}\n[rank1] b\n\n[rank0] par")
    (tmp_path / "logs" / "node1.log").write_text("[rank2] c\r[rank3] d\n")
    tail = LogTail(tmp_path, rank=3)
    tail.drain()
    assert capsys.readouterr().out == "[node1 node1] [rank3] d\n"
    tail = LogTail(tmp_path)
    tail.drain()
    assert capsys.readouterr().out.splitlines() == ["[gpu01 node0] [rank0] a", "[gpu01 node0] [rank1] b",
                                                    "[node1 node1] [rank2] c", "[node1 node1] [rank3] d"]
    with open(tmp_path / "logs" / "node0.log", "a") as f:
        f.write("t\n")
    tail.drain()
    assert capsys.readouterr().out == "[gpu01 node0] [rank0] part\n"

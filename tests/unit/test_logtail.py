"""`orchestrate logs` / `attach` output: node log lines prefixed `[host nodeR rankG]` (a rank's, tagged `[rankG]: ` by
the node agent) or `[host nodeR]` (the launcher's, the agent's), filtered by node, rank and regular expression,
heartbeat lines and partial lines held back; `--rank` and `--node` read only the one node's log."""

from __future__ import annotations

import builtins
import json
import time

from orchestrator.cli.logtail import LogTail, log_filter, node_of_rank


def test_log_filter():
    keep = log_filter(1, 3, None)  # rank 3 lives on node 1 with rank 2
    assert keep(1, 3, "loss 1.0") and not keep(1, None, "NCCL INFO ...") and not keep(1, 2, "loss 1.0")
    assert not keep(0, 3, "loss 1.0")
    keep = log_filter(0, None, r"^loss \d")
    assert keep(0, 1, "loss 2") and keep(0, None, "loss 3") and not keep(0, 1, "step 2") and not keep(1, 1, "loss 2")
    assert all(log_filter(None, None, None)(n, r, "x") for n in (0, 5) for r in (None, 0, 9))


def test_node_of_rank_from_the_plan():
    plan = {"procs_per_node": 2, "node_plans": [{"node_rank": 0, "ranks": [0, 1]}, {"node_rank": 1, "ranks": [2, 3]}]}
    assert [node_of_rank(plan, g) for g in range(4)] == [0, 0, 1, 1]
    assert node_of_rank({"procs_per_node": 4}, 9) == 2  # (a plan without ranks per node)


def _run_dir(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "plan.json").write_text(json.dumps({"procs_per_node": 2, "node_plans": [
        {"node_rank": 0, "host": "gpu01", "ranks": [0, 1]}, {"node_rank": 1, "host": "", "ranks": [2, 3]}]}))
    (tmp_path / "logs" / "node0.log").write_text(
        "[rank0]: a\nORCHESTRATE_HB {}\nW1128 launcher warning\n[rank1]: b\n\n[rank0]: par")
    (tmp_path / "logs" / "node1.log").write_text(
        "[rank2]: c\r[rank3]: d\n[rank3]: Traceback (most recent call last):\n[rank3]:   File \"x.py\", line 1\n"
        "[rank3]: RuntimeError: boom\norchestrate node agent: rank 3 died\n[rank2]: [rank3]: not rank 3's\n")
    return tmp_path


def test_log_tail_prefixes_each_line_with_node_and_rank(tmp_path, capsys):
    tail = LogTail(_run_dir(tmp_path))
    tail.drain()
    assert capsys.readouterr().out.splitlines() == [
        "[gpu01 node0 rank0] a", "[gpu01 node0] W1128 launcher warning", "[gpu01 node0 rank1] b",
        "[node1 node1 rank2] c", "[node1 node1 rank3] d", "[node1 node1 rank3] Traceback (most recent call last):",
        "[node1 node1 rank3]   File \"x.py\", line 1", "[node1 node1 rank3] RuntimeError: boom",
        "[node1 node1] orchestrate node agent: rank 3 died", "[node1 node1 rank2] [rank3]: not rank 3's"]
    with open(tmp_path / "logs" / "node0.log", "a") as f:
        f.write("t\n")
    tail.drain()
    assert capsys.readouterr().out == "[gpu01 node0 rank0] part\n"  # a partial line waits for its end


def test_rank_filter_is_exact_and_grep_applies_to_the_text(tmp_path, capsys):
    _run_dir(tmp_path)
    LogTail(tmp_path, rank=3).drain()
    assert capsys.readouterr().out.splitlines() == [
        "[node1 node1 rank3] d", "[node1 node1 rank3] Traceback (most recent call last):",
        "[node1 node1 rank3]   File \"x.py\", line 1", "[node1 node1 rank3] RuntimeError: boom"]
    LogTail(tmp_path, rank=3, grep=r"^RuntimeError").drain()
    assert capsys.readouterr().out == "[node1 node1 rank3] RuntimeError: boom\n"
    LogTail(tmp_path, node=0, grep="warning").drain()
    assert capsys.readouterr().out == "[gpu01 node0] W1128 launcher warning\n"
    LogTail(tmp_path, rank=5).drain()  # a rank that no node holds: nothing
    assert capsys.readouterr().out == ""


def test_rank_reads_only_the_holding_nodes_log_of_1024(tmp_path, capsys, monkeypatch):
    """`logs JOB --rank R` at 1,024 nodes x 8: one log opened (the node of rank R), no listing of logs/, fast."""
    nodes, ppn = 1024, 8
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "plan.json").write_text(json.dumps({"procs_per_node": ppn, "node_plans": [
        {"node_rank": n, "host": f"gpu{n:04d}", "ranks": list(range(n * ppn, (n + 1) * ppn))} for n in range(nodes)]}))
    for n in range(nodes):
        (logs / f"node{n}.log").write_text("".join(f"[rank{g}]: step 1\n" for g in range(n * ppn, (n + 1) * ppn))
                                           + "launcher line\n")
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *a, **kw):
        opened.append(str(file))
        return real_open(file, *a, **kw)
    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(type(logs), "glob", lambda *a, **k: (_ for _ in ()).throw(AssertionError("listed logs/")))
    t0 = time.perf_counter()
    tail = LogTail(tmp_path, rank=5003)
    tail.drain()
    tail.drain()  # (follow: the next poll opens the same one file again)
    took = time.perf_counter() - t0
    assert [p for p in opened if p.endswith(".log")] == [str(logs / "node625.log")] * 2
    assert capsys.readouterr().out == "[gpu0625 node625 rank5003] step 1\n"
    assert took < 2.0, took
    opened.clear()
    LogTail(tmp_path, node=7).drain()
    assert [p for p in opened if p.endswith(".log")] == [str(logs / "node7.log")]
    assert len(capsys.readouterr().out.splitlines()) == ppn + 1


def test_log_tail_before_the_node_log_exists(tmp_path, capsys):
    (tmp_path / "plan.json").write_text(json.dumps({"procs_per_node": 1, "node_plans": [{"node_rank": 0}]}))
    tail = LogTail(tmp_path, rank=0)
    tail.drain()  # no logs/ yet: nothing, no error
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "node0.log").write_text("[rank0]: up\n")
    tail.drain()
    assert capsys.readouterr().out == "[node0 node0 rank0] up\n"

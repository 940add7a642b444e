"""What a run dir's hang evidence turns into (orchestrator.node.hangevidence), without a GPU: NCCL's own recorder
dumps (RUN_DIR/stacks/nccl_trace_rank_<G>, torch's pickle) and py-spy stacks feed the same analysis; an NCCL RAS
summary is kept in diagnosis.json; evidence carried back over SSH (`absorb`) lands only under hangs/ and stacks/.
(The NCCL path was not run on a GPU: these are fixtures in torch's dump format.)"""

from __future__ import annotations

import json
import pickle

from orchestrator.node.hangevidence import absorb, diagnose_run, export
from orchestrator.node.rundir import RunDir


def nccl_entry(seq: int, op: str, state: str) -> dict:
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": 10**18 + seq,
            "input_sizes": [[1024]], "output_sizes": [[1024]], "state": state, "is_p2p": False,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": False,
            "timeout_ms": 600000, "frames": []}


def test_nccl_dumps_and_pyspy_stacks_give_the_verdict(tmp_path):
    rd = RunDir(tmp_path)
    rd.mkdir(RunDir.STACKS)
    rd.mkdir(RunDir.HANGS)
    for g in range(4):  # rank 3 completed #9 and never entered #10; the others are inside all_reduce #10
        entries = [nccl_entry(s, "all_reduce", "completed") for s in range(1, 10)]
        if g != 3:
            entries.append(nccl_entry(10, "all_reduce", "started"))
        (rd.stacks / f"nccl_trace_rank_{g}").write_bytes(pickle.dumps(
            {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
             "entries": entries}))
        rd.write_json(RunDir.hang_status_rel(g), {"rank": g, "pid": 100 + g, "status": "no_answer", "asked": 5.0})
        where = "    load (data.py:7)\n    main (train.py:30)\n" if g == 3 else "    main (train.py:41)\n"
        rd.write_text(f"{RunDir.STACKS}/rank{g}.txt", f'Thread 0x1 (idle): "MainThread"\n{where}')
    rd.write_text(f"{RunDir.HANGS}/ras_gpu01.txt", "RAS: 1 rank of communicator 0xabc missing: rank 3 (gpu02)\n")
    d = diagnose_run(rd, 4)
    assert d is not None and d.culprits[0] == 3
    assert d.line.startswith("hang at all_reduce #10 (group 0): rank 3 never entered it; rank 3 is in data.py:7 "
                             "in load"), d.line
    body = rd.diagnosis()
    assert body["sources"]["3"] == "nccl dump+py-spy" and body["never_entered"] == [3]
    assert "rank 3 (gpu02)" in body["nccl_ras"]["gpu01"]
    rd.write_json(RunDir.hang_status_rel(0), {"rank": 0, "pid": 100, "status": "stopped", "asked": 5.0})
    assert diagnose_run(rd, 4).stopped == (0,)
    assert diagnose_run(rd, 4, since=6.0).stopped == ()  # (an earlier attempt's statuses do not count)


def test_evidence_carried_back_lands_only_where_it_belongs(tmp_path):
    node = RunDir(tmp_path / "node")
    node.mkdir(RunDir.HANGS)
    node.write_json(RunDir.hang_evidence_rel(2), {"rank": 2, "t": 1.0})
    node.write_json(RunDir.hang_status_rel(2), {"rank": 2, "status": "answered", "asked": 1.0})
    files = export(node, [2])
    assert set(files) == {"hangs/rank2.json", "hangs/rank2.status.json"}
    here = RunDir(tmp_path / "here")
    absorb(here, {**files, "../evil": "x", "plan.json": "{}", "hangs/../../x": "y"})
    assert json.loads(here.path("hangs/rank2.json").read_text())["rank"] == 2
    assert not (tmp_path / "evil").exists() and not here.path("plan.json").exists()

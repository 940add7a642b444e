"""The pure hang analysis (orchestrator.core.hangs): culprit, desync, stack classes, stopped, no answer, NCCL dumps,
and its time over 1,024 x 8 ranks' synthetic evidence."""

import time

from orchestrator.core.hangs import (NO_ANSWER, STOPPED, Entry, RankEvidence, diagnose, entries_from_fr,
                                     groups_from_fr, parse_pyspy)

WAIT = (("/u/train.py", 30, "main", "dist.all_reduce(t)"),
        ("/v/site-packages/torch/distributed/c10d_logger.py", 83, "wrapper", ""),
        ("/v/site-packages/torch/distributed/distributed_c10d.py", 3000, "all_reduce", ""))
SLEEP = (("/u/train.py", 28, "main", "batch = load_batch()"), ("/u/train.py", 41, "load_batch", "time.sleep(600)"))


def entries(n: int, op: str = "all_reduce", last_op: str | None = None, state: str = "scheduled"):
    out = [Entry(i, op, "0", "completed" if state == "completed" and i < n else state, ((4,),), 100.0 + i)
           for i in range(1, n + 1)]
    if last_op:
        out[-1] = Entry(n, last_op, "0", state, ((4,),), 100.0 + n)
    return tuple(out)


def test_the_rank_that_never_entered_is_the_culprit_with_its_stack():
    ev = [RankEvidence(r, entries=entries(57), main_stack=WAIT) for r in (0, 1, 3)]
    ev.append(RankEvidence(2, entries=entries(56), main_stack=SLEEP))
    d = diagnose(ev, 4)
    assert d.culprits[0] == 2 and d.missing == (2,)
    assert d.collective == {"op": "all_reduce", "seq": 57, "group": "0"}
    assert d.line.startswith("hang at all_reduce #57 (group 0): rank 2 never entered it; rank 2 is in "
                             "train.py:41 in load_batch (time.sleep(600)); 3 ranks wait in all_reduce #57")
    assert [c.ranks for c in d.classes] == [(0, 1, 3), (2,)]
    body = d.to_dict()
    assert body["never_entered"] == [2] and body["stack_classes"][1]["ranks"] == [2]
    assert body["last_collectives"]["2"][-1]["seq"] == 56


def test_desync_names_both_ops():
    ev = [RankEvidence(r, entries=entries(9), main_stack=WAIT) for r in (0, 1, 2)]
    ev.append(RankEvidence(3, entries=entries(9, last_op="broadcast"), main_stack=WAIT))
    d = diagnose(ev, 4)
    assert d.culprits[0] == 3 and not d.missing
    assert d.desync == {"op": "broadcast", "ranks": [3]}
    assert "desync: rank 3 is in broadcast #9 while the others are in all_reduce" in d.line


def test_stopped_rank_is_named_when_the_others_all_entered():
    ev = [RankEvidence(r, entries=entries(12), main_stack=WAIT) for r in (0, 2, 3)]
    ev.append(RankEvidence(1, status=STOPPED, main_stack=SLEEP, source="py-spy", pid=4242))
    d = diagnose(ev, 4)
    assert d.culprits == (1,) and d.stopped == (1,)
    assert "rank 1 (process 4242 is stopped)" in d.line and "3 ranks wait in all_reduce #12" in d.line


def test_no_answer_and_missing_evidence():
    ev = [RankEvidence(r, entries=entries(5), main_stack=WAIT) for r in (0, 1)]
    d = diagnose(ev, 4)  # ranks 2, 3 gave nothing
    assert d.no_answer == (2, 3) and d.culprits == (2, 3)
    assert "ranks 2, 3 did not answer" in d.line
    ev.append(RankEvidence(2, status=NO_ANSWER))
    ev.append(RankEvidence(3, entries=entries(4), main_stack=SLEEP))
    d = diagnose(ev, 4)
    assert d.culprits[0] == 3 and "rank 2 did not answer" in d.line


def test_stack_minority_without_recorder_evidence():
    ev = [RankEvidence(r, main_stack=WAIT) for r in (0, 1, 2)] + [RankEvidence(3, main_stack=SLEEP)]
    d = diagnose(ev, 4)
    assert d.collective is None and d.culprits == (3,)
    assert "rank 3 is in train.py:41 in load_batch" in d.line


def test_an_even_picture_names_no_one():
    d = diagnose([RankEvidence(r, entries=entries(5), main_stack=WAIT) for r in range(4)], 4)
    assert d.culprits == () and "no rank stands out" in d.line


def test_nccl_dump_and_pyspy_text():
    raw = [{"collective_seq_id": 7, "profiling_name": "nccl:all_reduce", "process_group": ["0", "default_pg"],
            "state": "completed", "input_sizes": [[8]], "time_created_ns": 5_000_000_000},
           {"collective_seq_id": 8, "profiling_name": "nccl:all_gather", "process_group": ["0", "default_pg"],
            "state": "started", "input_sizes": [[8]], "time_created_ns": 6_000_000_000},
           {"p2p_seq_id": 1, "is_p2p": True, "profiling_name": "nccl:send"}]
    es = entries_from_fr(raw)
    assert [(e.seq, e.op, e.state) for e in es] == [(7, "all_reduce", "completed"), (8, "all_gather", "started")]
    assert groups_from_fr({"0": {"name": "0", "ranks": "[0, 1]"}}) == {"0": (0, 1)}
    d = diagnose([RankEvidence(0, entries=es), RankEvidence(1, entries=es[:1])], 2)
    assert d.collective == {"op": "all_gather", "seq": 8, "group": "0"} and d.culprits[0] == 1
    text = ('Process 12: python train.py\nPython v3.11\n\nThread 0x7F (idle): "MainThread"\n'
            '    load_batch (train.py:41)\n    main (train.py:28)\n    <module> (train.py:50)\n'
            'Thread 0x80 (idle): "orchestrate-hangs"\n    wait (threading.py:320)\n')
    assert parse_pyspy(text) == (("train.py", 50, "<module>", ""), ("train.py", 28, "main", ""),
                                 ("train.py", 41, "load_batch", ""))


def test_scale_1024_nodes_x_8_ranks_one_culprit_one_desync():
    n, culprit, odd = 8192, 5000, 7001
    ev = []
    for r in range(n):
        if r == culprit:
            ev.append(RankEvidence(r, entries=entries(56), main_stack=SLEEP))
        elif r == odd:
            ev.append(RankEvidence(r, entries=entries(57, last_op="all_gather"), main_stack=WAIT))
        else:
            ev.append(RankEvidence(r, entries=entries(57), main_stack=WAIT))
    t0 = time.perf_counter()
    d = diagnose(ev, n)
    took = time.perf_counter() - t0
    assert d.culprits[:2] == (culprit, odd)
    assert d.line.startswith("hang at all_reduce #57 (group 0): rank 5000 never entered it; desync: rank 7001 is in "
                             "all_gather #57")
    assert len(d.line) < 400
    print(f"analysis of {n} ranks x 57 entries: {took:.2f} s")
    assert took < 10.0

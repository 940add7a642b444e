"""The dashboard's pure pieces (issue #35): the readers it added where the CLI's live (heartbeat.read_since, LogTail's
tail and offsets, views.job_times / job_progress), its snapshot cache, and that every value on a page is escaped."""

from __future__ import annotations

import json
import threading
import time

from orchestrator.cli.logtail import LogTail
from orchestrator.cli.views import job_progress, job_times
from orchestrator.node.heartbeat import read_since
from orchestrator.web import pages
from orchestrator.web.data import Snapshots


def _beats(path, steps, t0=1000.0):
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"t": t0 + s, "rank": 0, "step": s, "loss": 1.0 / s, "tokens": 100 * s,
                                "event": "step"}) + "\n")


def test_read_since_gives_what_came_after_the_offset_with_the_record_before(tmp_path):
    hb = tmp_path / "rank0.jsonl"
    _beats(hb, range(1, 6))
    recs, end = read_since(hb, 0)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and end == hb.stat().st_size
    _beats(hb, [6, 7])
    with open(hb, "a") as f:
        f.write('{"t": 1, "rank": 0, "st')  # an unfinished line waits for the next look
    recs, end2 = read_since(hb, end)
    assert [r["step"] for r in recs][-2:] == [6, 7] and 5 in [r["step"] for r in recs]  # (the one before: a rate)
    assert end2 < hb.stat().st_size
    assert read_since(hb, end2) == ([], end2)


def test_log_tail_starts_near_the_end_and_goes_on_from_offsets(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "plan.json").write_text(json.dumps({"node_plans": [{"node_rank": 0, "host": "h", "ranks": [0, 1]}]}))
    log = tmp_path / "logs" / "node0.log"
    log.write_text("".join(f"[rank{i % 2}]: line {i}\n" for i in range(1000)) + "[rank0]: part")
    tail = LogTail(tmp_path, tail_bytes=200)
    lines = list(tail.lines())
    assert lines and lines[-1] == "[h node0 rank1] line 999" and len(lines) < 20  # no partial first line
    pos = tail.positions()
    with open(log, "a") as f:
        f.write("ial\n[rank1]: new\n")
    again = LogTail(tmp_path, rank=1, offsets=pos)
    assert list(again.lines()) == ["[h node0 rank1] new"]
    assert list(LogTail(tmp_path, grep="line 99[89]", tail_bytes=200).lines()) == ["[h node0 rank0] line 998",
                                                                            "[h node0 rank1] line 999"]


def test_job_times_and_progress(tmp_path):
    rec = {"state": "COMPLETED", "created": 100.0, "updated": 200.0}
    events = [{"t": 100.0, "state": "PENDING"}, {"t": 103.0, "state": "QUEUED"}, {"t": 130.0, "state": "RUNNING"},
              {"t": 190.0, "state": "COMPLETED"}]
    assert job_times(rec, events) == {"queue_wait_s": 30.0, "run_s": 60.0}
    assert job_times({**rec, "state": "QUEUED"}, events[:2], now=150.0) == {"queue_wait_s": 50.0, "run_s": None}
    (tmp_path / "heartbeats").mkdir()
    _beats(tmp_path / "heartbeats" / "rank0.jsonl", range(1, 5))
    p = job_progress(str(tmp_path))
    assert p["step"] == 4 and p["loss"] == 0.25 and p["tokens_per_s"] == 100.0


def test_snapshots_answer_a_stale_result_at_once_and_read_it_again_behind():
    calls = []
    slow = threading.Event()

    def read():
        calls.append(time.monotonic())
        if len(calls) > 1:
            slow.wait(5)
        return len(calls)

    snaps = Snapshots(fresh_s=0.05, keep_s=30)
    assert snaps.get("k", read) == 1
    assert snaps.get("k", read) == 1  # fresh
    time.sleep(0.1)
    t = time.monotonic()
    assert snaps.get("k", read) == 1 and time.monotonic() - t < 0.5  # stale: at once, a refresh started behind
    assert snaps.get("k", read) == 1 and len(calls) == 2  # (one refresh at a time)
    slow.set()
    deadline = time.monotonic() + 5
    while snaps.get("k", read) != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert snaps.get("k", read) == 2


def test_every_value_on_a_page_is_escaped():
    evil = '<script>alert(1)</script>"'
    html = pages.queue_table({"now": 0.0, "running": [], "queued": [
        {"id": evil, "position": 1, "waiting_for": evil, "holders": [{"what": evil, "holder": {"job": evil,
                                                                                                "submitter": evil}}],
         "since": 1.0, "created": 1.0, "nodes": 1, "cluster": evil, "stale": False}]})
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<script>" not in pages.not_found("job", evil)

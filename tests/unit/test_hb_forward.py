"""The agent's forwarded heartbeats (Agent.forward_heartbeats -> write_lines, issue #29): a cycle's records go out in
one write (one SSH packet over the agent's channel, not one per record), each on a line of its own, the first after a
newline (a rank's unfinished line is never glued to it), no write larger than a pipe's atomic one when it can be
helped; the SSH side parses every one back."""

from __future__ import annotations

import json
import os
import threading

from orchestrator.node.agent import write_lines
from orchestrator.node.heartbeat import HB_PREFIX, parse_forwarded


def writes(lines: list[str], most: int = 4096) -> list[bytes]:
    r, w = os.pipe()
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.extend(iter(lambda: os.read(r, 1 << 20), b"")))
    t.start()
    seen: list[bytes] = []
    real = os.write

    def spy(fd: int, data: bytes) -> int:
        seen.append(bytes(data))
        return real(fd, data)
    os.write = spy  # type: ignore[assignment]
    try:
        write_lines(w, lines, most)
    finally:
        os.write = real  # type: ignore[assignment]
        os.close(w)
    t.join()
    os.close(r)
    assert b"".join(out) == b"".join(seen)
    return seen


def test_a_cycle_of_records_is_one_write_each_on_its_own_line():
    recs = [{"rank": g, "step": 7, "event": "step"} for g in range(8)]
    lines = [HB_PREFIX + json.dumps(r, sort_keys=True) for r in recs]
    [one] = writes(lines)
    assert one.startswith(b"\n") and one.endswith(b"\n")
    got = [parse_forwarded(x.decode()) for x in one.split(b"\n") if x]
    assert got == recs
    # after a rank's unfinished line ("50%|####" of a progress bar) every record still parses
    glued = (b"50%|####" + one).split(b"\n")
    assert [parse_forwarded(x.decode()) for x in glued[1:] if x] == recs


def test_large_cycles_are_cut_at_the_atomic_size_between_lines_and_nothing_is_written_for_none():
    lines = [HB_PREFIX + json.dumps({"rank": g, "pad": "x" * 300}) for g in range(40)]
    seen = writes(lines, most=4096)
    assert len(seen) > 1 and all(len(s) <= 4096 for s in seen)
    assert all(s.startswith(b"\n") and s.endswith(b"\n") for s in seen)
    assert [x for s in seen for x in s.split(b"\n") if x] == [x.encode() for x in lines]
    assert writes([]) == []

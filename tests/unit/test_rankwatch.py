"""The node agent's rank watch on real processes: a rank that dies before finishing is reported at once with
its exit status (read while it is a zombie, before its parent reaps it); clean ends are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.node.proctools import TOKEN_VAR, zombie_exit_status
from orchestrator.node.rankwatch import RankDeath, RankWatch, exit_record, last_event

SCRIPT = r"""
import json, os, sys, time
hb, event, code = sys.argv[1], sys.argv[2], int(sys.argv[3])
if event != "none":
    with open(os.path.join(hb, "rank%s.jsonl" % os.environ["RANK"]), "a") as f:
        f.write(json.dumps({"t": time.time(), "rank": int(os.environ["RANK"]), "step": 3, "event": event}) + "\n")
print("ready", flush=True)
time.sleep(60 if code < 0 else 0.5)  # alive while the watch finds it
os._exit(code)
"""


def start_rank(tmp_path: Path, token: str, rank: int, event: str, code: int) -> subprocess.Popen:
    env = dict(os.environ, **{TOKEN_VAR: token, "RANK": str(rank)})
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), event, str(code)], env=env,
                         stdout=subprocess.PIPE, start_new_session=True)  # like torchrun's workers
    assert p.stdout.readline().strip() == b"ready"
    return p


def watch(tmp_path: Path, token: str, ranks: list[int]) -> tuple[threading.Thread, dict]:
    box: dict = {}
    stop = threading.Event()
    w = RankWatch(token, ranks, tmp_path, scan_every=0.05)
    t = threading.Thread(target=lambda: box.update(death=w.wait(stop.is_set), at=time.monotonic()), daemon=True)
    t.start()
    box["stop"] = stop
    return t, box


def test_sigkilled_rank_is_reported_at_once_with_its_signal(tmp_path):
    token = f"t{os.getpid()}a"
    p = start_rank(tmp_path, token, 1, "step", -1)
    t, box = watch(tmp_path, token, [1])
    time.sleep(0.3)  # the watch has found the rank
    k = time.monotonic()
    p.kill()
    t.join(5)
    death = box["death"]
    assert isinstance(death, RankDeath), death
    assert (death.rank, death.pid, death.status, death.last_event) == (1, p.pid, -9, "step")
    assert death.exit_code == 137
    assert "rank 1" in death.describe() and "SIGKILL" in death.describe() and "(exit -9)" in death.describe()
    assert box["at"] - k < 0.5
    p.wait()


@pytest.mark.parametrize("event,code,expect", [("step", 3, 3), ("none", 2, 2), ("end", 0, None),
                                               ("preempted", 143, None), ("none", 0, None), ("end", 1, None)])
def test_exit_classification(tmp_path, event, code, expect):
    token = f"t{os.getpid()}{event}{code}"
    p = start_rank(tmp_path, token, 0, event, code)
    t, box = watch(tmp_path, token, [0])
    t.join(5)
    assert not t.is_alive()
    death = box["death"]
    if expect is None:
        assert death is None, death
    else:
        assert death is not None and death.status == expect and death.exit_code == expect
    p.wait()


@pytest.mark.parametrize("record,event,expect", [
    ("sys.exit(3)", "step", 3),      # asked for 3 before finishing: named with its code
    ("sys.exit(0)", "step", None),   # a clean exit: torchrun's to report
    ("raise SystemExit(4)", "step", None),  # left through Python's exit, code unknown: torchrun knows it
    ("sys.exit(2)", "end", None),    # failing after "end": torchrun's, as with a status read in time
    ("os._exit(9)", "step", "unknown"),  # no record (or one of another pid): status unknown before finishing
    ("other pid", "step", "unknown")])
def test_reaped_before_read_uses_the_ranks_own_exit_record(tmp_path, record, event, expect):
    """torchrun reaped the rank before the watch read its zombie: the rank's exit record (written by the start-up
    hooks as the interpreter exits, with this process's pid) gives the code; without a record of that pid the status
    stays unknown."""
    from orchestrator.node.hooks import HOOKS_DIR

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATE_", "RANK", "LOCAL_RANK"))}
    env.update(PYTHONPATH=HOOKS_DIR, ORCHESTRATE_HEARTBEAT_DIR=str(tmp_path), RANK="5")
    code = "import os, sys\n" + ("sys.exit(1)" if record == "other pid" else record)
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=60)  # reaped: no zombie left to read
    if record == "other pid":
        rec = json.loads((tmp_path / "rank5.exit").read_text())
        (tmp_path / "rank5.exit").write_text(json.dumps({**rec, "pid": rec["pid"] + 1}))
    (tmp_path / "rank5.jsonl").write_text(json.dumps({"event": event}) + "\n")
    found, _ = exit_record(tmp_path, 5, p.pid)
    assert found == (record not in ("os._exit(9)", "other pid")), err
    death = RankWatch("tok", [5], tmp_path)._classify(5, p.pid)
    if expect is None:
        assert death is None, death
    elif expect == "unknown":
        assert death is not None and death.status is None and "status unknown" in death.describe()
    else:
        assert death is not None and (death.status, death.exit_code) == (expect, expect)
        assert "exited with code 3 (exit 3)" in death.describe()


def test_stop_ends_the_watch(tmp_path):
    token = f"t{os.getpid()}stop"
    p = start_rank(tmp_path, token, 0, "step", -1)
    t, box = watch(tmp_path, token, [0])
    time.sleep(0.2)
    box["stop"].set()
    t.join(2)
    assert not t.is_alive() and box["death"] is None
    p.kill()
    p.wait()


def test_zombie_status_and_last_event(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import os; os._exit(7)"])
    deadline = time.monotonic() + 5
    while zombie_exit_status(p.pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert zombie_exit_status(p.pid) == 7
    p.wait()
    assert zombie_exit_status(p.pid) is None  # reaped
    f = tmp_path / "rank4.jsonl"
    assert last_event(tmp_path, 4) is None
    f.write_text(json.dumps({"event": "step"}) + "\n" + json.dumps({"event": "save"}) + "\n{partial")
    assert last_event(tmp_path, 4) == "save"


def test_a_declared_hang_asks_the_nccl_flight_recorder_to_dump(tmp_path):
    """keep_stacks writes one byte into each rank's NCCL debug-info FIFO (what torch's flight recorder waits on when
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE is set, as GPU plans do); a rank without one is skipped, nothing blocks."""
    import os
    import threading
    from orchestrator.node.ops import nccl_dump
    from orchestrator.node.rundir import RunDir
    rd = RunDir(tmp_path)
    rd.mkdir(RunDir.STACKS)
    fifo = rd.stacks / "nccl_pipe_rank_1"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    import time
    deadline = time.monotonic() + 5
    asked = []
    while not asked and time.monotonic() < deadline:  # until the reader has the FIFO open
        asked = nccl_dump(rd, [0, 1])
        time.sleep(0.01)
    reader.join(5)
    assert asked == [1] and got == [b"1"]

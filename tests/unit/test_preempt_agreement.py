"""PreemptionCallback's agreement schedule, with two real gloo ranks (orchestrator/node/hooks/orchestrate_trainer.py):
the ranks all-reduce only about every ORCHESTRATE_SIGNAL_CHECK_S seconds of training, yet always at the same steps
(each computes the next interval from the same all-reduced numbers), also at the last step; a signal seen by one
rank stops both at the same step, within the check interval plus one step."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RANK = r'''
import json, os, sys, time
from types import SimpleNamespace
import torch.distributed as dist
from orchestrator.node.hooks.orchestrate_trainer import PreemptionCallback
rank, port, signal_at, max_steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
cb = PreemptionCallback()
state = SimpleNamespace(global_step=0, max_steps=max_steps)
cb.on_train_begin(None, state, None)
checks, stopped = [], None
for step in range(1, max_steps + 1):
    time.sleep(0.002 if rank == 0 else 0.005)  # rank 1 is the slow one: its time per step sets the interval
    state.global_step = step
    if step == signal_at and rank == 1:
        cb.received = 15
    before = cb.checks
    control = cb.on_step_end(None, state, SimpleNamespace(should_save=False, should_training_stop=False))
    if cb.checks != before:
        checks.append(step)
    if control.should_training_stop:
        stopped = step
        break
print("RESULT " + json.dumps({"checks": checks, "stopped": stopped, "by": cb.stopped_by}), flush=True)
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, signal_at: int, max_steps: int, check_s: str) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = _free_port()
    env = {"PYTHONPATH": str(REPO), "ORCHESTRATE_SIGNAL_CHECK_S": check_s, "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(signal_at), str(max_steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[7:]) for o in outs]


def test_ranks_agree_rarely_but_at_the_same_steps_and_stop_together(tmp_path):
    r0, r1 = _run(tmp_path, signal_at=150, max_steps=400, check_s="0.05")
    assert r0["checks"] == r1["checks"], (r0, r1)  # the same schedule on both ranks
    assert r0["stopped"] == r1["stopped"] and r0["by"] == r1["by"] == 15, (r0, r1)
    # rank 1's ~5 ms+ per step and 0.05 s between agreements: about every 10 steps, not every step
    checks = r0["checks"]
    assert checks[0] == 1 and len(checks) < r0["stopped"] / 4, checks
    widest = max(b - a for a, b in zip(checks, checks[1:], strict=False))
    assert 150 <= r0["stopped"] <= 150 + widest, (r0["stopped"], checks)


def test_the_last_step_is_always_an_agreement_and_zero_means_every_step(tmp_path):
    r0, r1 = _run(tmp_path, signal_at=10**6, max_steps=37, check_s="10")
    assert r0["checks"] == r1["checks"] and r0["checks"][-1] == 37 and r0["stopped"] is None, (r0, r1)
    assert len(r0["checks"]) <= 3, r0["checks"]  # 10 s between agreements: the first step, the last, little else
    r0, r1 = _run(tmp_path, signal_at=5, max_steps=20, check_s="0")
    assert r0["checks"] == r1["checks"] == [1, 2, 3, 4, 5] and r0["stopped"] == r1["stopped"] == 5, (r0, r1)

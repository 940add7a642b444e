"""A slow rank named with zero code changes (issue #26 item 2), on 2 local nodes running the built-in SFT recipe:
rank 1 is made slow but alive (SIGSTOP / SIGCONT, stopped 25 ms of every 30 ms on average); the supervisor names it
from the ranks' own forward times (the hooks' "compute_s"), the job log says so, `status` shows it in the FWD/STEP
column and `status --json` carries the evidence; the same job unthrottled names no one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from badnodes import Throttler, job_ids, ranks_of
from helpers import cli

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _submit(tmp_path: Path, name: str, job_guard, slow_rank: int | None, window: int = 10):
    home = job_guard.home(tmp_path / name)
    args = ["submit", REPO / "recipes/configs/sft_tiny.yaml", "--nodes", "2", "trainer.max_steps=80",
            f"health.straggler.window={window}", f"trainer.output_dir={tmp_path / name / 'out'}"]
    throttle = None
    if slow_rank is not None:
        throttle = Throttler(lambda: ranks_of(job_ids(home)[-1]).get(slow_rank) if job_ids(home) else None,
                             stop_s=0.025, period_s=0.03)
    try:
        # one thread per rank: the 2 local nodes share this machine's 2 cores (on 2 threads each, the ranks take
        # turns on the cores and one of them really is slower now and then: a straggler, but of the test's making)
        p = cli(*args, env={"ORCHESTRATE_HOME": home, "OMP_NUM_THREADS": "1"}, cwd=REPO, timeout=600)
    finally:
        if throttle:
            throttle.stop()
    assert p.returncode == 0 and "COMPLETED" in p.stdout, (p.stdout + p.stderr)[-4000:]
    job = job_ids(home)[-1]
    st = json.loads(cli("status", job, "--json", env={"ORCHESTRATE_HOME": home}).stdout)
    text = cli("status", job, env={"ORCHESTRATE_HOME": home}).stdout
    return p.stdout + p.stderr, st, text, throttle


def test_a_rank_made_slow_is_named_and_an_even_run_names_no_one(tmp_path, job_guard):
    out, st, text, throttle = _submit(tmp_path, "slow", job_guard, slow_rank=1)
    assert throttle.cycles > 20, throttle.cycles
    assert "orchestrate: rank 1 on localhost is a straggler: " in out, out[-4000:]
    [named] = [s for s in st["stragglers"] if s["rank"] == 1]
    assert (named["action"], named["window"]) == ("warn", 10) and named["ratio"] > 1.3, named
    ranks = {r["rank"]: r for r in st["ranks"]}
    assert ranks[1]["straggler"]["rank"] == 1
    assert ranks[0]["compute_s"] > 0 and ranks[1]["compute_s"] > 0, ranks  # (the evidence now; named: then)
    assert named["median_s"] > 1.3 * named["others_s"] > 0, named
    assert "slow     rank 1 on localhost: " in text and "SLOW " in text, text
    out, st, text, _ = _submit(tmp_path, "even", job_guard, slow_rank=None, window=20)
    assert st["stragglers"] == [] and "straggler" not in out and "SLOW" not in text, (st["ranks"], text)
    assert all(r["compute_s"] for r in st["ranks"]), st["ranks"]

"""An emulated job at a small scale of issue #29, driven as a user does (the CLI's `submit` in a process of its own),
for tests/local_backend/test_scale_local.py and tests/ssh/test_ssh_scale.py; bench/bench_teardown.py runs the big
sizes. Every node's ranks are emulated (orchestrator.node.emulate); agents, records, backend and Supervisor are real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.node.proctools import alive, marked

REPO = Path(__file__).resolve().parents[1]
JOB_YAML = "run:\n  script: %s\nlaunch: {procs_per_node: %d}\n"


def wait_for(pred, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def threads(pid: int) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Threads:")))


def run_and_kill(tmp: Path, nodes: int, ppn: int = 8, cluster: Path | None = None, start_timeout: float = 60.0,
                 gone_timeout: float = 20.0) -> dict:
    """Submit an emulated nodes x ppn job, wait until every agent started and every rank heartbeat, kill node
    nodes // 2's emulated launcher; returns what was seen (threads of the submitter, seconds until the last process of
    the job was gone, the outcome, ...). Everything it started is gone when it returns."""
    (tmp / "train.py").write_text("raise SystemExit('emulated: never run')\n")
    (tmp / "job.yaml").write_text(JOB_YAML % (tmp / "train.py", ppn))
    home = tmp / "home"
    argv = [sys.executable, "-m", "orchestrator.cli", "submit", str(tmp / "job.yaml"), "--nodes", str(nodes)]
    if cluster is not None:
        argv += ["--cluster", str(cluster)]
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "ORCHESTRATE_EMULATE": "rate=2,steps=100000",
           "PYTHONPATH": str(REPO)}
    log = open(tmp / "submit.log", "w")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    seen: dict[int, str] = {}
    try:
        def records():
            assert proc.poll() is None, (tmp / "submit.log").read_text()[-2000:]
            runs = home / "runs"
            rd = next(iter(runs.iterdir()), None) if runs.is_dir() else None
            if rd is None:
                return None
            try:
                return rd, [json.loads((rd / "nodes" / str(r) / "agent.json").read_text()) for r in range(nodes)]
            except (OSError, ValueError):
                return None
        rd, agents = wait_for(records, start_timeout, f"{nodes} node agents")
        pending = set(range(nodes * ppn))

        def all_beat() -> bool:
            for g in list(pending):
                try:
                    if b'"step"' in (rd / "heartbeats" / f"rank{g}.jsonl").read_bytes()[:4096]:
                        pending.discard(g)
                except OSError:
                    pass
            return not pending
        wait_for(all_beat, start_timeout, "every rank's first heartbeat", every=0.3)
        for a in agents:
            seen[a["agent_pid"]] = f"agent{a['node_rank']}"
            seen[a["pid"]] = f"launch{a['node_rank']}"
            for p in marked(a["token"]):
                seen.setdefault(p, f"marked{a['node_rank']}")
        n_threads = threads(proc.pid)
        n_fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        victim = nodes // 2
        t_kill = time.time()
        t0 = time.monotonic()
        os.kill(agents[victim]["pid"], signal.SIGKILL)
        wait_for(lambda: not any(alive(p) for p in seen) and not any(marked(a["token"]) for a in agents),
                 gone_timeout, "every process of the job gone", every=0.01)
        gone = time.monotonic() - t0
        rc = proc.wait(timeout=60)
        outcome = json.loads((rd / "outcome.json").read_text())
        return {"rc": rc, "gone_s": gone, "threads": n_threads, "fds": n_fds, "victim": victim, "outcome": outcome,
                "decision_s": (outcome["teardown_at"] - t_kill) if outcome.get("teardown_at") else None,
                "processes": len(seen), "log": (tmp / "submit.log").read_text()}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in seen:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        log.close()

"""The supervisor of a job: the submit process that runs and monitors it, recorded in
$ORCHESTRATE_HOME/supervisors/<job>.pid (cancel signals it; status asks the scheduler itself only when none is
left). `submit --detach` starts one in its own session, re-running the same submit with the same job id,
output to supervisors/<job>.log, and returns once the job is recorded.
"""

from __future__ import annotations

import os
import sys


def detach(argv: list[str], prepared) -> int:
    """Re-run this very submit (same job id) as a supervisor in its own session; wait until it is recorded."""
    import subprocess
    import time
    from orchestrator.store import JobStore, home
    job = prepared.plan.job_id
    logs = home() / "supervisors"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    child = [a for a in argv if a not in ("--detach", "-d")] + ["--job-id", job, "--quiet", "--color", "never"]
    with open(logs / f"{job}.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *child], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rec = JobStore().get(job)
        if rec is not None and rec.state not in ("PENDING",):
            print(f"job {job} {rec.state} (supervisor pid {proc.pid}); follow it with: orchestrate attach {job}")
            return 0
        if proc.poll() is not None:
            tail = (logs / f"{job}.log").read_text(errors="replace").strip().splitlines()[-1:]
            print(f"orchestrate: error: job {job} did not start: {' '.join(tail)}", file=sys.stderr)
            return proc.returncode or 1
        time.sleep(0.2)
    print(f"job {job} submitted (supervisor pid {proc.pid}); orchestrate attach {job}")
    return 0


def record_self(job: str) -> None:
    """Record this submit process as the job's supervisor (cancel signals it: it tears down and records)."""
    from orchestrator.store import home
    d = home() / "supervisors"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / f"{job}.pid").write_text(str(os.getpid()))


def forget_self(job: str) -> None:
    """The supervisor is done: its pid file goes (a later process with the same pid is no supervisor of this job)."""
    from orchestrator.store import home
    try:
        path = home() / "supervisors" / f"{job}.pid"
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except (OSError, ValueError):
        pass


def live_supervisor(job: str) -> int | None:
    from orchestrator.node.proctools import alive
    from orchestrator.store import home
    try:
        pid = int((home() / "supervisors" / f"{job}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and alive(pid) else None

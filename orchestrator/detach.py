"""The supervisor of a job: the submit process that runs and monitors it, recorded in
$ORCHESTRATE_HOME/supervisors/<job>.pid (cancel signals it; status asks the scheduler itself only when none is
left). `submit --detach` starts one in its own session, re-running the same submit with the same job id,
output to supervisors/<job>.log, and returns once the job is recorded.
"""

from __future__ import annotations

import os
import sys


def start_background(child: list[str], log, started, what: str, say_started, wait_s: float = 120) -> int:
    """Run `orchestrate CHILD` in a session of its own, its output appended to `log` (0600), and wait until
    `started()` is true (then `say_started(pid)`, 0) or it exits first (its last line named, its exit code); after
    `wait_s`, say it was submitted and return 0. The one way `submit --detach` (a job, a sweep) leaves a process."""
    import subprocess
    import time
    from pathlib import Path
    log = Path(log)
    with open(log, "ab") as out:
        os.chmod(log, 0o600)
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *child], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if started():
            say_started(proc.pid)
            return 0
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            print(f"orchestrate: error: {what} did not start: {' '.join(tail)}", file=sys.stderr)
            return proc.returncode or 1
        time.sleep(0.2)
    print(f"{what} submitted (pid {proc.pid}); orchestrate attach {what.split()[-1]}")
    return 0


def detach(argv: list[str], prepared, say=print) -> int:
    """Re-run this very submit (same job id) as a supervisor in its own session; wait until it is recorded (then
    `say` the line that tells so)."""
    from orchestrator.store import JobStore, home
    job = prepared.plan.job_id
    logs = home() / "supervisors"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    child = [a for a in argv if a not in ("--detach", "-d")] + ["--job-id", job, "--quiet", "--color", "never"]

    def recorded() -> bool:
        rec = JobStore().get(job)
        return rec is not None and rec.state not in ("PENDING",)
    return start_background(child, logs / f"{job}.log", recorded, f"job {job}", lambda pid: say(
        f"job {job} {JobStore().get(job).state} (supervisor pid {pid}); follow it with: orchestrate attach {job}"))


def record_self(job: str) -> None:
    """Record this submit process as the job's supervisor (cancel signals it: it tears down and records)."""
    from orchestrator.store import home
    d = home() / "supervisors"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    from orchestrator.node.proctools import process_start_time
    path = d / f"{job}.pid"
    try:
        path.write_text(f"{os.getpid()} {process_start_time() or 0:.3f}\n")  # pid and when it started
    except OSError:
        path.unlink(missing_ok=True)  # (a full disk: no empty pid file left behind)
        raise


def forget_self(job: str) -> None:
    """The supervisor is done: its pid file goes (a later process with the same pid is no supervisor of this job)."""
    from orchestrator.store import home
    try:
        path = home() / "supervisors" / f"{job}.pid"
        if path.read_text().split()[0] == str(os.getpid()):
            path.unlink()
    except (OSError, ValueError):
        pass


def live_supervisor(job: str) -> int | None:
    """The pid of the job's supervisor while it runs; None when none does (its pid file names a process that ended,
    or a later, unrelated process that got the same pid: the recorded start time tells them apart)."""
    from orchestrator.node.proctools import same_process
    from orchestrator.store import home
    try:
        words = (home() / "supervisors" / f"{job}.pid").read_text().split()
        pid, start = int(words[0]), float(words[1]) if len(words) > 1 else 0.0
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid != os.getpid() and same_process(pid, start or None) else None  # (0: start not recorded)


def live_sweep_runner(doc: dict) -> int | None:
    """The pid of a sweep's runner while it runs (its record's `runner_pid` is still that process: an orchestrate
    submit, with --sweep or of a job file with a sweep: block, not a point's (--job-id), started before the sweep
    was recorded); None when it is gone."""
    from pathlib import Path
    from orchestrator.node.proctools import process_start_time
    pid = doc.get("runner_pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    started = process_start_time(pid)
    ok = (b"submit" in argv and b"--job-id" not in argv and started is not None
          and started <= float(doc.get("created") or 0) + 1)
    return pid if ok else None

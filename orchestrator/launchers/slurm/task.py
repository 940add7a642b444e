"""What runs inside a SLURM job: the submitit task that starts the node agent, and the restart policy.

`AgentTask` is the picklable callable submitit runs once per node (one task per node). It starts
`python -m orchestrator.node.agent RUN_DIR` with its output going straight to RUN_DIR/logs/node<R>.log
(not through submitit's in-memory buffering), exits with the agent's code (so SLURM's ExitCode and
srun's --kill-on-bad-exit see the real failure) and implements submitit's `checkpoint()`: on the
preemption / time-limit signal (USR2, delivered by SLURM to every process of the step: the agents and
the ranks save a checkpoint) the task of global rank 0 waits for its agent to finish saving, asks the
restart policy and returns the resubmission (submitit then runs `scontrol requeue`) or None.

The restart policy (`may_requeue`) is shared with the standalone job.sbatch
(`python -m orchestrator.launchers.slurm.task requeue RUN_DIR --max-restarts N`, exit 0 = requeue): restarts are
bounded by slurm.max_restarts (SLURM_RESTART_COUNT), and a job whose global step did not move since
the previous restart (a crash/preemption loop without progress) is not requeued again. Every decision
is appended to RUN_DIR/restarts.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


# ------------------------------------------------------------------------------------- restart policy

def latest_step(run_dir: Path) -> int | None:
    """The highest global step any rank reported in RUN_DIR/heartbeats (None: no step yet)."""
    best = None
    for f in sorted((run_dir / "heartbeats").glob("rank*.jsonl")):
        try:
            lines = f.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int) and (best is None or step > best):
                best = step
    return best


def restart_history(run_dir: Path) -> list[dict]:
    out = []
    try:
        text = (run_dir / "restarts.jsonl").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def may_requeue(run_dir: Path, restart_count: int, max_restarts: int, job_id: str = "",
                record: bool = True) -> tuple[bool, str]:
    """Decide whether a preempted / timed-out run may be requeued; append the decision."""
    step = latest_step(run_dir)
    previous = [h for h in restart_history(run_dir) if h.get("decision") == "requeue"]
    if restart_count >= max_restarts:
        ok, why = False, f"restart budget spent ({restart_count} of slurm.max_restarts={max_restarts})"
    elif previous and (step is None or (previous[-1].get("step") is not None and step <= previous[-1]["step"])):
        ok, why = False, (f"no progress since the last restart (global step {step}, was {previous[-1].get('step')}):"
                          " not requeuing a loop")
    else:
        ok, why = True, f"requeue {restart_count + 1} of {max_restarts} at global step {step}"
    if record:
        try:
            with open(run_dir / "restarts.jsonl", "a") as f:
                f.write(json.dumps({"t": time.time(), "slurm_job_id": job_id, "restart": restart_count,
                                    "step": step, "decision": "requeue" if ok else "stop", "reason": why}) + "\n")
        except OSError:
            pass
    return ok, why


# ------------------------------------------------------------------------------------- the task

class AgentTask:
    """submitit callable: run this node's agent; checkpointable (see the module docstring)."""

    def __init__(self, run_dir: str, python: str, max_restarts: int, save_wait_s: float = 60.0):
        self.run_dir = run_dir
        self.python = python
        self.max_restarts = max_restarts
        self.save_wait_s = save_wait_s
        self._pid: int | None = None
        self._rc: int | None = None
        self._signals: list[int] = []

    def __getstate__(self) -> dict:
        return {"run_dir": self.run_dir, "python": self.python, "max_restarts": self.max_restarts,
                "save_wait_s": self.save_wait_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # -- child bookkeeping with os.waitpid: safe to call from the signal handler while __call__ polls
    def _poll(self) -> int | None:
        if self._rc is not None or self._pid is None:
            return self._rc
        try:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
        except ChildProcessError:
            self._rc = self._rc if self._rc is not None else 1
            return self._rc
        if pid == 0:
            return None
        self._rc = os.waitstatus_to_exitcode(status)
        if self._rc < 0:
            self._rc = 128 - self._rc
        return self._rc

    def _wait(self, timeout: float | None) -> int | None:
        """Wait for the agent: woken by its pidfd the moment it exits (no polling delay at the end of every job);
        reaping stays with `_poll`, so the checkpoint handler may call this while __call__ waits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pidfd = None
        if self._pid is not None:
            try:
                pidfd = os.pidfd_open(self._pid)
            except (OSError, AttributeError):  # already reaped, or no pidfd (old kernel): poll
                pidfd = None
        try:
            while self._poll() is None:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return None
                if pidfd is not None:
                    select.select([pidfd], [], [], left)
                else:
                    time.sleep(min(left, 0.05))
            return self._rc
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _chain(self, signum: int) -> None:
        prev = signal.getsignal(signum)

        def handler(s, frame):
            self._signals.append(s)
            if callable(prev):
                prev(s, frame)
        signal.signal(signum, handler)

    def __call__(self) -> int:
        run_dir = Path(self.run_dir)
        node = int(os.environ.get("SLURM_NODEID", "0"))
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        log_path = run_dir / "logs" / f"node{node}.log"
        if restart > self.max_restarts:
            with open(log_path, "a") as log:
                log.write(f"orchestrate: restart {restart} exceeds slurm.max_restarts={self.max_restarts}; giving up\n")
            os._exit(3)
        for s in (signal.SIGUSR2, signal.SIGTERM):
            self._chain(s)
        with open(log_path, "ab", buffering=0) as log:
            log.write(f"orchestrate: SLURM job {os.environ.get('SLURM_JOB_ID')} node {node} "
                      f"({os.uname().nodename}), restart {restart}\n".encode())
            proc = subprocess.Popen([self.python, "-m", "orchestrator.node.agent", self.run_dir],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._pid = proc.pid
        proc.returncode = 0  # we reap with os.waitpid; keep Popen's destructor quiet
        rc = self._wait(None)
        if rc and signal.SIGUSR2 in self._signals and os.environ.get("SLURM_PROCID", "0") != "0":
            # Preempted: the rank-0 task is checkpointing and requeueing; exiting non-zero here would make
            # --kill-on-bad-exit cut that short. The requeue (or the end of the job) ends this task.
            time.sleep(self.save_wait_s + 30)
        sys.stdout.flush()
        sys.stderr.flush()
        if rc:
            os._exit(rc)
        return 0

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on global rank 0 when USR2 arrives; None = do not requeue."""
        import submitit
        self._wait(self.save_wait_s)  # the ranks got USR2 too: let them save and exit
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        ok, why = may_requeue(Path(self.run_dir), restart, self.max_restarts, os.environ.get("SLURM_JOB_ID", ""))
        print(f"orchestrate: preemption notice: {why}", flush=True)
        return submitit.helpers.DelayedSubmission(AgentTask(**self.__getstate__())) if ok else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.launchers.slurm.task")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rq = sub.add_parser("requeue", help="exit 0 when a preempted job may be requeued (records the decision)")
    rq.add_argument("run_dir")
    rq.add_argument("--max-restarts", type=int, required=True)
    args = ap.parse_args(argv)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    ok, why = may_requeue(Path(args.run_dir), restart, args.max_restarts, os.environ.get("SLURM_JOB_ID", ""))
    print(f"orchestrate: {why}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

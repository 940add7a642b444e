"""What runs inside a SLURM job: the submitit task that starts the node agent, and its requeue decision.

`AgentTask` is the picklable callable submitit runs once per node (one task per node). It starts the
Submission's agent argv (`python -m orchestrator.node RUN_DIR`) with its output going straight to
RUN_DIR/logs/node<R>.log
(not through submitit's in-memory buffering), exits with the agent's code (so SLURM's ExitCode and
srun's --kill-on-bad-exit see the real failure) and implements submitit's `checkpoint()`: on the
preemption / time-limit signal (USR2, delivered by SLURM to every process of the step: the agents and
the ranks save a checkpoint) the task of global rank 0 waits for its agent to finish saving, asks the
restart policy and returns the resubmission (submitit then runs `scontrol requeue`) or None.

The requeue decision (`may_requeue`) is the one `orchestrator.supervise.RestartPolicy` (health.max_restarts, the
crash-loop rule), also used by the standalone job.sbatch (`python -m launchers.slurm.task requeue
RUN_DIR --max-restarts N`, exit 0 = requeue). Every decision, and every requeue nobody here decided
(`scontrol requeue`), is appended to RUN_DIR/restarts.jsonl: the submitter counts them all.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def may_requeue(run_dir: Path, restart_count: int, max_restarts: int, job_id: str = "") -> tuple[bool, str]:
    """The preempted run may be requeued? RestartPolicy's decision, recorded in RUN_DIR/restarts.jsonl."""
    from orchestrator.node.rundir import RunDir
    from orchestrator.supervise import RestartPolicy
    d = RestartPolicy(max_restarts).record(RunDir(run_dir), restart_count, "preempted (SLURM signal)",
                                           by="slurm-requeue", slurm_job_id=job_id, counted=restart_count)
    return d.restart, d.why


def note_external_requeue(run_dir: Path, restart_count: int, job_id: str) -> None:
    """A run started by a requeue nobody here decided (`scontrol requeue`, a node failure): count it too, once."""
    from orchestrator.node.rundir import AttemptRecord, RunDir
    rd = RunDir(run_dir)
    known = sum(1 for a in rd.attempts() if a.decision == "restart" and a.slurm_job_id == job_id)
    if restart_count > known:
        rd.append_attempt(AttemptRecord(t=time.time(), attempt=restart_count - 1, decision="restart",
                                        reason="requeued by SLURM (scontrol requeue, or a node failure)",
                                        step=rd.furthest_step(), by="slurm", slurm_job_id=job_id))


# ------------------------------------------------------------------------------------- the task

class AgentTask:
    """submitit callable: run this node's agent; checkpointable (see the module docstring)."""

    def __init__(self, run_dir: str, argv: list[str], max_restarts: int, save_wait_s: float = 60.0):
        self.run_dir = run_dir
        self.argv = list(argv)  # the Submission's agent argv: exactly what `render` shows
        self.max_restarts = max_restarts
        self.save_wait_s = save_wait_s
        self._pid: int | None = None
        self._rc: int | None = None
        self._signals: list[int] = []

    def __getstate__(self) -> dict:
        return {"run_dir": self.run_dir, "argv": self.argv, "max_restarts": self.max_restarts,
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
        os.umask(0o077)  # the logs and records this task and its agent write are owner-only
        run_dir = Path(self.run_dir)
        node = int(os.environ.get("SLURM_NODEID", "0"))
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        log_path = run_dir / "logs" / f"node{node}.log"
        if restart > self.max_restarts:
            with open(log_path, "a") as log:
                log.write(f"orchestrate: restart {restart} exceeds health.max_restarts={self.max_restarts}; "
                          "giving up\n")
            os._exit(3)
        if restart and node == 0:
            note_external_requeue(run_dir, restart, os.environ.get("SLURM_JOB_ID", ""))
        for s in (signal.SIGUSR2, signal.SIGTERM):
            self._chain(s)
        with open(log_path, "ab", buffering=0) as log:
            log.write(f"orchestrate: SLURM job {os.environ.get('SLURM_JOB_ID')} node {node} "
                      f"({os.uname().nodename}), restart {restart}\n".encode())
            proc = subprocess.Popen(self.argv,
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
    ap = argparse.ArgumentParser(prog="python -m launchers.slurm.task")
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

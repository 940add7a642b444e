"""The SLURM backend: one job of N nodes x 1 task, each task a node agent, submitted with submitit.

Owns: checking a cluster's `slurm:` block and the SLURM client tools before anything is submitted
(ConfigError, exit 2), the submitit submission (checkpointable `launchers.slurm.task.AgentTask`,
USR2 `signal_lead_s` ahead of the time limit, `srun --kill-on-bad-exit=1`), the standalone job.sbatch
written next to it (launchers.slurm.sbatch, same behaviour, for `sbatch` by hand), the SLURM state table,
status / cancel / logs for `slurm://<jobid>` handles and the root cause of a failed job (which node,
which rank, which exit code, from the agents' exit.json and the node logs).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

from launchers.base import run_dir_logs
from orchestrator.node.agent import agent_argv
from orchestrator.node.heartbeat import HeartbeatTail
from orchestrator.node.proctools import Cancelled, run_apart
from orchestrator.node.rundir import RunDir
from orchestrator.events import Beat, Line, NodeEnded, SchedulerEnd
from orchestrator.types import JobHandle, JobState, JobStatus, NodeCommand, NodeStatus, Submission
from launchers.slurm.sbatch import check_slurm, extra_option, render_sbatch, time_seconds
from orchestrator.errors import ConfigError, LaunchError, Problem, SubmitCancelled
from orchestrator.core.jobplan import LaunchPlan

# SLURM job state -> (orchestrate state, terminal?). Base states of `scontrol show job` / sacct.
STATE_TABLE: dict[str, tuple[str, bool]] = {
    "PENDING": ("PENDING", False), "CONFIGURING": ("PENDING", False), "REQUEUED": ("PENDING", False),
    "REQUEUE_HOLD": ("PENDING", False), "REQUEUE_FED": ("PENDING", False), "RESV_DEL_HOLD": ("PENDING", False),
    "RUNNING": ("RUNNING", False), "COMPLETING": ("RUNNING", False), "SUSPENDED": ("RUNNING", False),
    "STOPPED": ("RUNNING", False), "SIGNALING": ("RUNNING", False), "STAGE_OUT": ("RUNNING", False),
    "RESIZING": ("RUNNING", False), "UPDATE_DB": ("RUNNING", False), "POWER_UP_NODE": ("PENDING", False),
    # PREEMPTED is terminal only when the job is not requeued (then it shows up as PENDING again)
    "PREEMPTED": ("FAILED", True),
    "COMPLETED": ("COMPLETED", True),
    "CANCELLED": ("CANCELLED", True), "REVOKED": ("CANCELLED", True),
    "FAILED": ("FAILED", True), "TIMEOUT": ("FAILED", True), "NODE_FAIL": ("FAILED", True),
    "OUT_OF_MEMORY": ("FAILED", True), "BOOT_FAIL": ("FAILED", True), "DEADLINE": ("FAILED", True),
    "SPECIAL_EXIT": ("FAILED", True),
}
WHY = {
    "TIMEOUT": "hit its time limit (slurm.time) without being requeued",
    "PREEMPTED": "was preempted and not requeued",
    "NODE_FAIL": "lost a node (NODE_FAIL)",
    "OUT_OF_MEMORY": "ran out of memory (OUT_OF_MEMORY): raise slurm.mem or lower the batch size",
    "BOOT_FAIL": "could not boot its nodes (BOOT_FAIL)",
    "DEADLINE": "missed its deadline",
}


def map_state(raw: str) -> tuple[str, bool, str]:
    """'CANCELLED by 0' / 'FAILED' / 'RUNNING' -> (orchestrate state, terminal, SLURM base state)."""
    base = (raw or "").strip().split()[0].rstrip("+") if (raw or "").strip() else "UNKNOWN"
    state, terminal = STATE_TABLE.get(base, ("UNKNOWN", False))
    return state, terminal, base


def job_id_of(handle: JobHandle | str) -> str:
    uri = handle.uri if isinstance(handle, JobHandle) else handle
    m = re.fullmatch(r"slurm://(\d+(?:_\d+)?)", uri.strip())
    if not m:
        raise ConfigError(Problem("job", f"not a SLURM job handle: {uri!r} (expected slurm://<jobid>, or "
                                         "slurm://<array job id>_<task> for a sweep's point)"))
    return m.group(1)


def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {key: value} (values without spaces; good enough for what we read)."""
    out: dict[str, str] = {}
    for tok in text.split():
        k, sep, v = tok.partition("=")
        if sep and k not in out:
            out[k] = v
    return out


@functools.cache
def own_session_executor() -> type:
    """submitit's SlurmExecutor whose `sbatch` runs in a session of its own (`setsid`, where the system has it), when
    this process answers SIGINT with a handler of its own (orchestrate's CLI: it only records the request).

    A Ctrl-C or hang-up of the submitting terminal goes to its whole foreground process group: it would kill a
    running sbatch, possibly after SLURM queued the job but before sbatch printed its id, leaving a job nobody
    records or cancels. Kept out of that group, sbatch finishes; orchestrate's own handler has meanwhile asked for
    the cancel (the supervisor scancels the returned job) or the detach (the job runs on). Under Python's default
    SIGINT (a library caller), a KeyboardInterrupt would leave submitit without waiting for the id: there sbatch
    stays in the caller's group and dies with it, as it always did. (Built once, on first use: importing submitit
    costs start-up time that only a SLURM submit should pay.)"""
    import submitit

    class OwnSessionExecutor(submitit.SlurmExecutor):
        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            argv = super()._make_submission_command(submission_file_path)
            apart = shutil.which("setsid") is not None and \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            return ["setsid", *argv] if apart else argv  # (not a group leader: setsid execs, no fork to wait for)

        def submit_array(self, fns: list) -> list:
            """ONE sbatch `--array=0-N%P` (P: the parameter array_parallelism), task i running fns[i]: submitit's
            own array path (SlurmExecutor._internal_process_submissions, as `executor.batch()` takes it), with this
            class's sbatch (a session of its own), and an array also for one task (submitit submits that as a
            plain job). Returns the tasks' submitit jobs (ids `<array job id>_<i>`)."""
            import uuid
            from submitit.core import utils
            folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
            folder.mkdir(parents=True, exist_ok=True)
            pickles = []
            for fn in fns:
                delayed = utils.DelayedSubmission(fn)
                delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
                path = folder / f"{uuid.uuid4().hex}.pkl"
                delayed.dump(path)
                pickles.append(path)
            array = type(self)(self.folder, self.max_num_timeout, python=self.python)
            array.update_parameters(**self.parameters)
            array.parameters["map_count"] = len(fns)
            first = array._submit_command(array._submitit_command_str)
            tasks = list(range(first.num_tasks))
            jobs = [submitit.slurm.slurm.SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=tasks)
                    for i in range(len(fns))]
            for job, path in zip(jobs, pickles, strict=True):
                job.paths.move_temporary_file(path, "submitted_pickle")
            return jobs

    return OwnSessionExecutor


class SlurmLauncher:
    kind = "slurm"

    def __init__(self, cluster=None, poll: float = 0.5):
        self.cluster = cluster
        self.poll = poll

    # -------------------------------------------------------------- pure
    @property
    def _slurm(self):
        return getattr(self.cluster, "slurm", None)

    @property
    def _name(self) -> str:
        return getattr(self.cluster, "name", None) or "slurm"

    def prepare(self, plan: LaunchPlan) -> Submission:
        problems = check_slurm(self._slurm, self._name, plan.procs_per_node, plan.accelerator)
        if problems:
            raise ConfigError(problems, source=getattr(self.cluster, "source", None))
        slurm = self._slurm
        script = render_sbatch(plan, slurm)
        argv = agent_argv(plan.python, plan.run_dir)  # each task binds its rank from SLURM_NODEID
        nodes = tuple(NodeCommand(node_rank=n.node_rank, host="", argv=argv, env={}, secret_env=plan.secret_env)
                      for n in plan.node_plans)
        pyxis = plan.container is not None and plan.container.runtime == "pyxis"
        return Submission(kind=self.kind, run_dir=plan.run_dir, nodes=nodes, files={RunDir.SBATCH: script},
                          extra={"submitit": self.submitit_parameters(plan), "python": plan.python,
                                 "max_restarts": int(plan.health.max_restarts or 0), "nodes": plan.nodes,
                                 "job_id": plan.job_id, "pyxis": pyxis,
                                 "image": plan.container.image if plan.container is not None else None})

    def submitit_parameters(self, plan: LaunchPlan) -> dict:
        """SlurmExecutor parameters equivalent to job.sbatch (time given exactly, as a string)."""
        s = self._slurm
        secs = time_seconds(s.time) or 3600
        extra: dict = {"time": s.time, "requeue": True}
        for arg in s.extra_sbatch:
            k, v = extra_option(arg)
            extra[k] = v
        params = {
            "job_name": plan.job_id, "nodes": plan.nodes, "ntasks_per_node": 1,
            "time": max(1, (secs + 59) // 60), "signal_delay_s": s.signal_lead_s,
            "srun_args": ["--kill-on-bad-exit=1"], "stderr_to_stdout": True,
            "additional_parameters": extra,
        }
        for key in ("partition", "account", "qos", "cpus_per_task", "mem", "constraint"):
            if getattr(s, key):
                params[key] = getattr(s, key)
        if s.gpus_per_node:
            params["gpus_per_node"] = s.gpus_per_node
        if s.exclusive:
            params["exclusive"] = True
        if s.exclude:
            params["exclude"] = ",".join(s.exclude)
        if s.setup:
            params["setup"] = list(s.setup)
        return params

    # -------------------------------------------------------------- checks with the cluster
    def preflight(self, script_path: Path | None = None, cancel: threading.Event | None = None) -> None:
        """The SLURM tools exist, and SLURM itself accepts the job (`sbatch --test-only`, run apart like sbatch (see
        own_session_executor): a hang-up does not fail the check; `cancel` set stops it: SubmitCancelled, also when
        it comes after the check, nothing having been submitted)."""
        missing = [t for t in ("sbatch", "srun", "scontrol", "scancel") if shutil.which(t) is None]
        if missing:
            raise ConfigError(Problem(f"cluster {self._name!r}", f"{', '.join(missing)} not found on PATH: submit "
                                      "from a SLURM login node (or add SLURM's bin directory to PATH)"))
        if script_path is None:
            return
        try:
            r = run_apart(["sbatch", "--test-only", str(script_path)], timeout=60, cancel=cancel)
        except Cancelled:
            raise SubmitCancelled("cancelled during the `sbatch --test-only` check: nothing was submitted") from None
        except subprocess.TimeoutExpired:
            raise LaunchError("sbatch --test-only did not answer within 60 s (is slurmctld up?)",
                              host=self._name, argv=["sbatch", "--test-only"]) from None
        if r.returncode == 0:
            if cancel is not None and cancel.is_set():  # (came between the check's end and sbatch)
                raise SubmitCancelled("cancelled before sbatch: nothing was submitted")
            return
        stderr = r.stderr
        err = " ".join(line.replace("sbatch: error:", "").strip() for line in stderr.splitlines()
                       if "error" in line.lower()) or stderr.strip() or f"exit {r.returncode}"
        where = f"cluster {self._name!r}"
        if "partition" in err.lower():
            where = "slurm.partition" if self._slurm and self._slurm.partition else \
                "slurm.partition (missing: this cluster has no default partition)"
        elif "account" in err.lower():
            where = "slurm.account" if self._slurm and self._slurm.account else \
                "slurm.account (missing: this cluster requires one)"
        elif "qos" in err.lower():
            where = "slurm.qos"
        elif "gres" in err.lower() or "gpu" in err.lower() or (
                "node configuration" in err.lower() and self._slurm and self._slurm.gpus_per_node):
            where = "slurm.gpus_per_node"
            err += gres_note(self._slurm)
        raise ConfigError(Problem(where, f"SLURM rejects the job: {err}"), source=getattr(self.cluster, "source", None))

    # -------------------------------------------------------------- side effects
    def submit(self, submission: Submission, run_dir: RunDir, cancel: threading.Event | None = None) -> "SlurmJob":
        """One sbatch. `cancel` set before it (during the `--test-only` check): SubmitCancelled, nothing submitted.
        sbatch itself is not interrupted (own_session_executor): a cancel or hang-up that comes meanwhile is the
        supervisor's to act on, with the job id sbatch returns (scancel, or detach)."""
        if submission.extra.get("pyxis"):  # the task step runs in the image: no submitit python there, the script
            return self.submit_sbatch(submission, run_dir, cancel)
        run_dir.mkdir(RunDir.LOGS)
        run_dir.write_files(submission.files)
        self.preflight(run_dir.path(RunDir.SBATCH), cancel)
        from launchers.slurm.task import AgentTask
        run_dir.mkdir("submitit")
        ex = own_session_executor()(folder=str(run_dir.root / "submitit" / "%j"), python=submission.extra["python"],
                                    max_num_timeout=int(submission.extra["max_restarts"]))
        ex.update_parameters(**submission.extra["submitit"])
        task = AgentTask(str(run_dir.root), list(submission.nodes[0].argv), int(submission.extra["max_restarts"]),
                         save_wait_s=max(5.0, min(60.0, self._slurm.signal_lead_s - 5.0)) if self._slurm else 30.0)
        old = os.umask(0o077)  # submitit's pickles and SLURM's output files (sbatch passes SLURM_UMASK) owner-only
        try:
            job = ex.submit(task)
        except Exception as e:  # noqa: BLE001 - submitit raises a plain error carrying sbatch's stderr
            raise LaunchError(f"sbatch failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}",
                              host=self._name, argv=["sbatch"]) from None
        finally:
            os.umask(old)
        run_dir.write_text(RunDir.SLURM_JOB_ID, f"{job.job_id}\n")
        handle = JobHandle(uri=f"slurm://{job.job_id}", data={"run_dir": str(run_dir.root), "job_id": str(job.job_id),
                                                              "nodes": submission.extra.get("nodes")})
        return SlurmJob(self, handle, run_dir, int(submission.extra.get("nodes") or len(submission.nodes)))

    def submit_sbatch(self, submission: Submission, run_dir: RunDir, cancel: threading.Event | None = None
                      ) -> "SlurmJob":
        """Submit the rendered job.sbatch with plain `sbatch` (what a user does by hand; what runs a pyxis job)."""
        run_dir.mkdir(RunDir.LOGS)
        run_dir.write_files(submission.files)
        script = run_dir.path(RunDir.SBATCH)
        self.preflight(script, cancel)
        jid = self._sbatch_script(script, bool(submission.extra.get("pyxis")), str(submission.extra.get("job_id")))
        run_dir.write_text(RunDir.SLURM_JOB_ID, f"{jid}\n")
        handle = JobHandle(uri=f"slurm://{jid}", data={"run_dir": str(run_dir.root), "job_id": jid,
                                                       "nodes": submission.extra.get("nodes")})
        return SlurmJob(self, handle, run_dir, int(submission.extra.get("nodes") or len(submission.nodes)))

    def _sbatch_script(self, script: Path, pyxis: bool, name: str) -> str:
        """`sbatch --parsable SCRIPT` (a pyxis job needs srun's --container-image: refused here without it); the
        SLURM job id."""
        if pyxis and not srun_knows_containers():
            raise ConfigError(Problem("container.runtime", f"pyxis: this cluster's srun has no --container-image "
                                                           f"(the pyxis plugin is not installed on {self._name!r}); "
                                                           "use runtime apptainer, enroot or podman"))
        old = os.umask(0o077)  # sbatch hands its umask to the job (SLURM_UMASK): the job's files are owner-only
        try:
            r = run_apart(["sbatch", "--parsable", str(script)], timeout=60)  # (apart: see own_session_executor)
        except subprocess.TimeoutExpired:
            raise LaunchError("sbatch did not answer within 60 s (is slurmctld up?); it may have queued the job "
                              f"before it was stopped: look for job name {name!r} in squeue",
                              host=self._name, argv=["sbatch", str(script)]) from None
        finally:
            os.umask(old)
        if r.returncode != 0:
            raise LaunchError("sbatch failed", host=self._name, argv=["sbatch", str(script)],
                              exit_code=r.returncode, stderr_tail=r.stderr[-2000:])
        return r.stdout.strip().split(";")[0]

    def submit_array(self, submissions: list[Submission], run_dirs: list[RunDir], *, parallel: int, name: str,
                     folder: Path, script: str, cancel: threading.Event | None = None) -> tuple[str, list[JobHandle]]:
        """A sweep's points as ONE array job through the same submitit path as one job (`submit`): one sbatch
        `--array=0-N%P` (at most `parallel` tasks running at once), task i an allocation of its own running point i's
        node agents (AgentTask) on its run dir, with its own restart budget (SLURM_RESTART_COUNT is the task's).
        FOLDER/job.sbatch (the array script `script`, render_array_sbatch: what a user submits by hand) is written and
        checked with `sbatch --test-only` first. Returns (array job id, each task's handle `slurm://<array>_<i>`)."""
        for sub, rd in zip(submissions, run_dirs, strict=True):
            rd.mkdir(RunDir.LOGS)
            rd.write_files(sub.files)
        sweep = RunDir(folder)
        sweep.mkdir()
        sweep.write_text(RunDir.SBATCH, script)
        self.preflight(sweep.path(RunDir.SBATCH), cancel)
        if any(sub.extra.get("pyxis") for sub in submissions):  # the task step runs in the image: the script itself
            array = self._sbatch_script(sweep.path(RunDir.SBATCH), True, name)
            return array, [self._array_handle(f"{array}_{i}", array, i, sub, rd)
                           for i, (sub, rd) in enumerate(zip(submissions, run_dirs, strict=True))]
        from launchers.slurm.task import AgentTask
        budget = [int(sub.extra["max_restarts"]) for sub in submissions]
        ex = own_session_executor()(folder=str(Path(folder) / "submitit" / "%j"), python=submissions[0].extra["python"],
                                    max_num_timeout=max(budget))
        ex.update_parameters(**dict(submissions[0].extra["submitit"], job_name=name, array_parallelism=parallel))
        wait = max(5.0, min(60.0, self._slurm.signal_lead_s - 5.0)) if self._slurm else 30.0
        tasks = [AgentTask(str(rd.root), list(sub.nodes[0].argv), n, save_wait_s=wait)
                 for sub, rd, n in zip(submissions, run_dirs, budget, strict=True)]
        old = os.umask(0o077)  # (as submit)
        try:
            jobs = ex.submit_array(tasks)
        except Exception as e:  # noqa: BLE001 - submitit raises a plain error carrying sbatch's stderr
            raise LaunchError(f"sbatch failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}",
                              host=self._name, argv=["sbatch", "--array"]) from None
        finally:
            os.umask(old)
        array = str(jobs[0].job_id).split("_")[0]
        return array, [self._array_handle(str(job.job_id), array, i, sub, rd)
                       for i, (job, sub, rd) in enumerate(zip(jobs, submissions, run_dirs, strict=True))]

    @staticmethod
    def _array_handle(jid: str, array: str, i: int, sub: Submission, rd: RunDir) -> JobHandle:
        """Array task i's handle `slurm://<array>_<i>`, its id kept in its run dir."""
        rd.write_text(RunDir.SLURM_JOB_ID, f"{jid}\n")
        return JobHandle(uri=f"slurm://{jid}", data={"run_dir": str(rd.root), "job_id": jid,
                                                     "nodes": sub.extra.get("nodes"), "array_job_id": array,
                                                     "array_task": i})

    def array_tasks(self, array: str) -> dict[int, str] | None:
        """{task index: SLURM state} of the array's tasks the controller still lists (squeue: a task that ended is
        gone from it); None when squeue cannot tell."""
        try:
            r = subprocess.run(["squeue", "-h", "-r", "-j", str(array), "-o", "%i %T"], capture_output=True, text=True,
                               timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode != 0:
            return {} if "Invalid job id" in r.stderr else None  # (forgotten by the controller: every task ended)
        out: dict[int, str] = {}
        for line in r.stdout.splitlines():
            words = line.split()
            m = re.fullmatch(rf"{re.escape(str(array))}_(\d+)", words[0]) if len(words) == 2 else None
            if m:
                out[int(m.group(1))] = words[1]
        return out

    def adopt(self, handle: JobHandle, run_dir: RunDir) -> "SlurmJob":
        """A job someone else submitted (a sweep's array task, submitted by the sweep's runner), watched from its
        start: its run dir holds nothing of an earlier attempt, so its logs and heartbeats are read from the
        beginning."""
        return SlurmJob(self, handle, run_dir, int(handle.data.get("nodes") or 0), from_start=True)

    # -------------------------------------------------------------- state
    def query(self, handle: JobHandle) -> dict:
        """{'state', 'terminal', 'slurm_state', 'reason', 'exit_code', 'restarts', 'nodelist'} from scontrol,
        else sacct (after the controller forgot the job)."""
        jid = job_id_of(handle)
        r = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and "JobState=" in r.stdout:
            kv = parse_kv(r.stdout)
            state, terminal, base = map_state(kv.get("JobState", ""))
            if base == "PREEMPTED" and kv.get("Requeue") == "1":  # it will run again (PreemptMode=REQUEUE)
                state, terminal = "PENDING", False
            return {"state": state, "terminal": terminal, "slurm_state": base, "reason": kv.get("Reason", ""),
                    "exit_code": kv.get("ExitCode", ""), "restarts": int(kv.get("Restarts", "0") or 0),
                    "nodelist": kv.get("NodeList", "")}
        r = subprocess.run(["sacct", "-X", "-n", "-P", "-j", jid, "-o", "State,ExitCode,NodeList,Reason"],
                           capture_output=True, text=True, timeout=30)
        line = next((ln for ln in r.stdout.splitlines() if ln.strip()), "")
        if not line:
            return {"state": "UNKNOWN", "terminal": False, "slurm_state": "UNKNOWN", "reason": "",
                    "exit_code": "", "restarts": 0, "nodelist": ""}
        parts = (line.split("|") + ["", "", "", ""])[:4]
        state, terminal, base = map_state(parts[0])
        return {"state": state, "terminal": terminal, "slurm_state": base, "reason": parts[3],
                "exit_code": parts[1], "restarts": 0, "nodelist": parts[2]}

    def status(self, handle: JobHandle, run_dir: RunDir) -> JobStatus:
        q = self.query(handle)
        nodes = tuple(NodeStatus(r, (run_dir.agent(r).host if run_dir.agent(r) else ""),
                                 "exited" if run_dir.exit(r) else ("running" if q["state"] == "RUNNING" else "unknown"),
                                 run_dir.exit(r).returncode if run_dir.exit(r) else None)
                      for r in range(int(handle.data.get("nodes") or 0)))
        return JobStatus(JobState(q["state"]) if q["state"] in JobState.__members__ else JobState.RUNNING, nodes,
                         scheduler_reason(job_id_of(handle), q) if q["terminal"] else "",
                         f"SLURM {q['slurm_state']}" + (f", {q['reason']}" if q.get("reason") not in ("", "None")
                                                        else ""))

    def cancel(self, handle: JobHandle, run_dir: RunDir | None = None) -> None:
        jid = job_id_of(handle)
        if shutil.which("scancel") is None:
            raise ConfigError(Problem(f"cluster {self._name!r}", "scancel not found on PATH"))
        r = subprocess.run(["scancel", jid], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise LaunchError(f"scancel {jid} failed", argv=["scancel", jid], exit_code=r.returncode,
                              stderr_tail=r.stderr[-1000:])

    def logs(self, handle: JobHandle, run_dir: RunDir, node: int | None = None) -> Iterator[str]:
        return run_dir_logs(run_dir, node)


UNKNOWN_GIVE_UP_S = 300.0


def srun_knows_containers() -> bool:
    """The pyxis plugin adds --container-image to srun."""
    try:
        r = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--container-image" in r.stdout


def parse_gres_gpus(gres: str) -> int:
    """GPUs in one node's GRES string (`gpu:8`, `gpu:h100:4(S:0-1)`, `gpu:2,shard:8`, `(null)`)."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        parts = item.split("(")[0].split(":")
        if parts and parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_nodes(partition: str | None = None) -> list[str] | None:
    """The nodes of a partition (the default one when None) that are not down or drained, from sinfo; None when
    sinfo cannot tell."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %t"] + (["-p", partition] if partition else [])
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    bad = ("down", "drain", "drng", "fail", "maint", "boot", "unk")
    return sorted({w[0] for w in (ln.split() for ln in r.stdout.splitlines()) if len(w) >= 2 and
                   not w[1].rstrip("*~#!%$@^-").startswith(bad)})


def gres_gpus(partition: str | None = None) -> dict[str, int]:
    """{node: GPUs} of a partition's nodes, from sinfo ({} when sinfo cannot tell)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %G"] + (["-p", partition] if partition else [])
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[str, int] = {}
    for line in r.stdout.splitlines():
        words = line.split()
        if len(words) >= 2:
            out[words[0]] = max(out.get(words[0], 0), parse_gres_gpus(words[1]))
    return out


def gres_note(slurm) -> str:
    """What the partition's nodes have, for a rejected GPU request: the nodes named with their GPU counts."""
    nodes = gres_gpus(getattr(slurm, "partition", None))
    if not nodes:
        return ""
    want = int(getattr(slurm, "gpus_per_node", 0) or 0)
    fit = [n for n, g in nodes.items() if g >= want]
    return (f" (slurm.gpus_per_node = {want}; GPUs per node: " + ", ".join(f"{n} {g}" for n, g in nodes.items())
            + f": {len(fit)} node(s) have {want} or more" + (f": {', '.join(fit)}" if fit else "") + ")")


def scheduler_reason(jid: str, q: dict) -> str:
    base = q["slurm_state"]
    if q["state"] == "CANCELLED":
        return f"SLURM job {jid} was cancelled (scancel)"
    if base in WHY:
        return f"SLURM job {jid} {base}: the job {WHY[base]}"
    if q["state"] == "FAILED":
        return f"SLURM job {jid} {base} (exit {q['exit_code'] or '?'}, reason {q['reason'] or '-'})"
    return ""


class SlurmJob:
    """A running SLURM job as the supervisor sees it: output lines (RUN_DIR/logs, the shared run dir), heartbeats
    (this attempt's), and at the scheduler's final word every node's end (its agent's ExitRecord) and the verdict.
    A requeued job (preemption) is the same attempt here: the scheduler says PENDING/RUNNING again."""

    decides_hangs_on_nodes = True
    grace = 0.0  # scancel: SLURM's own KillWait applies

    def __init__(self, launcher: SlurmLauncher, handle: JobHandle, run_dir: RunDir, nodes: int, poll: float = 0.5,
                 from_start: bool = False):
        self.launcher, self.handle, self.rd, self.poll = launcher, handle, run_dir, poll
        self.nodes = {r: "" for r in range(nodes)}
        self.beats = HeartbeatTail(run_dir.heartbeats, from_end=not from_start)
        self.offsets: dict[int, int] = {}  # where this attempt's output starts in each node log (not replayed)
        for r in ([] if from_start else run_dir.log_ranks()):
            try:
                self.offsets[r] = run_dir.log(r).stat().st_size
            except OSError:
                pass
        self.started = False  # the scheduler has not run it yet: no hang clock (supervise.Supervisor)
        self.unknown_since: float | None = None
        self.next_query = 0.0
        self.done = False
        self.cancelled = False

    def _lines(self) -> list:
        out: list = []
        for r in self.rd.log_ranks():
            off = self.offsets.get(r, 0)
            try:
                with open(self.rd.log(r), "rb") as fh:
                    fh.seek(off)
                    data = fh.read()
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1
            self.offsets[r] = off + cut
            out += [Line(r, line) for line in data[:cut].decode(errors="replace").splitlines() if line.strip()]
        return out

    def events(self, timeout: float) -> list:
        if self.done:
            time.sleep(timeout)
            return []
        time.sleep(timeout)
        out = self._lines() + [Beat(b) for b in self.beats.read()]
        if time.monotonic() < self.next_query:
            return out
        self.next_query = time.monotonic() + self.poll
        try:
            q = self.launcher.query(self.handle)
        except (OSError, subprocess.SubprocessError) as e:  # a busy or restarting controller: ask again later
            self.next_query = time.monotonic() + 5.0
            return out + [Line(0, f"orchestrate: cannot ask SLURM about job {job_id_of(self.handle)} ({e}); "
                                  "retrying in 5 s")]
        self.started = q["state"] == "RUNNING"
        if q["state"] == "UNKNOWN":  # purged from the controller and no accounting: do not wait forever
            self.unknown_since = self.unknown_since or time.monotonic()
            if time.monotonic() - self.unknown_since > UNKNOWN_GIVE_UP_S:
                self.done = True
                return out + [SchedulerEnd(JobState.FAILED, f"SLURM no longer knows job {job_id_of(self.handle)} "
                                                            f"(unknown for {UNKNOWN_GIVE_UP_S:.0f} s)")]
        else:
            self.unknown_since = None
        if not q["terminal"]:
            return out
        time.sleep(0.2)  # the last lines the tasks wrote
        out += self._lines() + [Beat(b) for b in self.beats.read()]
        self.done = True
        for r in self.nodes:
            rec, agent = self.rd.exit(r), self.rd.agent(r)
            host = agent.host if agent else (rec.host if rec and rec.host else "?")
            out.append(NodeEnded(r, host, rec.returncode if rec else None,
                                 self.rd.log_tail(r, 40), rec,
                                 "" if rec else f"no exit record from its agent (SLURM {q['slurm_state']})"))
        state = {"COMPLETED": JobState.COMPLETED, "CANCELLED": JobState.CANCELLED}.get(q["state"], JobState.FAILED)
        out.append(SchedulerEnd(state, scheduler_reason(job_id_of(self.handle), q)))
        return out

    def stop(self, reason: str, grace: float, nodes: set[int] | None = None) -> None:
        """A node failing ends the others through srun --kill-on-bad-exit; a hang or a cancel: scancel."""
        if reason.startswith("node ") or self.cancelled:
            return
        self.cancelled = True
        try:
            self.launcher.cancel(self.handle)
        except Exception:  # noqa: BLE001 - the job may be gone already
            pass

    def stopped_ranks(self, stacks: bool = True) -> dict[int, int]:
        return {}  # the nodes' own processes are not visible from here; their agents judged (and kept stacks)

    def close(self) -> None:
        pass


def read_job_id(run_dir: str | os.PathLike) -> str | None:
    try:
        return Path(run_dir, RunDir.SLURM_JOB_ID).read_text().strip() or None
    except OSError:
        return None

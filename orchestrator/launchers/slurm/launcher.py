"""The SLURM backend: one job of N nodes x 1 task, each task a node agent, submitted with submitit.

Owns: checking a cluster's `slurm:` block and the SLURM client tools before anything is submitted
(ConfigError, exit 2), the submitit submission (checkpointable `orchestrator.launchers.slurm.task.AgentTask`,
USR2 `signal_lead_s` ahead of the time limit, `srun --kill-on-bad-exit=1`), the standalone job.sbatch
written next to it (orchestrator.launchers.slurm.sbatch, same behaviour, for `sbatch` by hand), the SLURM state table,
status / cancel / logs for `slurm://<jobid>` handles and the root cause of a failed job (which node,
which rank, which exit code, from the agents' exit.json and the node logs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

from orchestrator.types import JobHandle, JobResult, NodeCommand, NodeExit, Submission
from orchestrator.launchers.slurm.sbatch import check_slurm, extra_option, render_sbatch, time_seconds
from orchestrator.errors import ConfigError, LaunchError, Problem
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
    m = re.fullmatch(r"slurm://(\d+)", uri.strip())
    if not m:
        raise ConfigError(Problem("job", f"not a SLURM job handle: {uri!r} (expected slurm://<jobid>)"))
    return m.group(1)


def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {key: value} (values without spaces; good enough for what we read)."""
    out: dict[str, str] = {}
    for tok in text.split():
        k, sep, v = tok.partition("=")
        if sep and k not in out:
            out[k] = v
    return out


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
        argv = (plan.python, "-m", "orchestrator.node.agent", plan.run_dir)
        nodes = tuple(NodeCommand(node_rank=n.node_rank, host="", argv=argv, env={}, secret_env=plan.secret_env)
                      for n in plan.node_plans)
        return Submission(kind=self.kind, run_dir=plan.run_dir, nodes=nodes, files={"job.sbatch": script},
                          extra={"sbatch": script, "submitit": self.submitit_parameters(plan),
                                 "python": plan.python, "max_restarts": slurm.max_restarts,
                                 "nodes": plan.nodes, "job_id": plan.job_id})

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
        if s.setup:
            params["setup"] = list(s.setup)
        return params

    # -------------------------------------------------------------- checks with the cluster
    def preflight(self, script_path: Path | None = None) -> None:
        """The SLURM tools exist, and SLURM itself accepts the job (`sbatch --test-only`)."""
        missing = [t for t in ("sbatch", "srun", "scontrol", "scancel") if shutil.which(t) is None]
        if missing:
            raise ConfigError(Problem(f"cluster {self._name!r}", f"{', '.join(missing)} not found on PATH: submit "
                                      "from a SLURM login node (or add SLURM's bin directory to PATH)"))
        if script_path is None:
            return
        r = subprocess.run(["sbatch", "--test-only", str(script_path)], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return
        err = " ".join(line.replace("sbatch: error:", "").strip() for line in r.stderr.splitlines()
                       if "error" in line.lower()) or r.stderr.strip() or f"exit {r.returncode}"
        where = f"cluster {self._name!r}"
        if "partition" in err.lower():
            where = "slurm.partition" if self._slurm and self._slurm.partition else \
                "slurm.partition (missing: this cluster has no default partition)"
        elif "account" in err.lower():
            where = "slurm.account" if self._slurm and self._slurm.account else \
                "slurm.account (missing: this cluster requires one)"
        elif "qos" in err.lower():
            where = "slurm.qos"
        elif "gres" in err.lower() or "gpu" in err.lower():
            where = "slurm.gpus_per_node"
        raise ConfigError(Problem(where, f"SLURM rejects the job: {err}"), source=getattr(self.cluster, "source", None))

    # -------------------------------------------------------------- side effects
    def submit(self, submission: Submission) -> JobHandle:
        run_dir = Path(submission.run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for rel, text in submission.files.items():
            p = run_dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        self.preflight(run_dir / "job.sbatch")
        import submitit
        from orchestrator.launchers.slurm.task import AgentTask
        ex = submitit.SlurmExecutor(folder=str(run_dir / "submitit" / "%j"), python=submission.extra["python"],
                                    max_num_timeout=int(submission.extra["max_restarts"]))
        ex.update_parameters(**submission.extra["submitit"])
        task = AgentTask(str(run_dir), submission.extra["python"], int(submission.extra["max_restarts"]),
                         save_wait_s=max(5.0, min(60.0, self._slurm.signal_lead_s - 5.0)) if self._slurm else 30.0)
        try:
            job = ex.submit(task)
        except Exception as e:  # submitit raises a plain error carrying sbatch's stderr
            raise LaunchError(f"sbatch failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e}",
                              host=self._name, argv=["sbatch"]) from None
        (run_dir / "slurm_job_id").write_text(f"{job.job_id}\n")
        return JobHandle(uri=f"slurm://{job.job_id}", data={"run_dir": str(run_dir), "job_id": str(job.job_id),
                                                            "nodes": submission.extra.get("nodes")})

    def submit_sbatch(self, submission: Submission) -> JobHandle:
        """Submit the rendered job.sbatch with plain `sbatch` (what a user does by hand)."""
        run_dir = Path(submission.run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for rel, text in submission.files.items():
            (run_dir / rel).write_text(text)
        self.preflight(run_dir / "job.sbatch")
        r = subprocess.run(["sbatch", "--parsable", str(run_dir / "job.sbatch")], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise LaunchError("sbatch failed", host=self._name, argv=["sbatch", str(run_dir / "job.sbatch")],
                              exit_code=r.returncode, stderr_tail=r.stderr[-2000:])
        jid = r.stdout.strip().split(";")[0]
        (run_dir / "slurm_job_id").write_text(f"{jid}\n")
        return JobHandle(uri=f"slurm://{jid}", data={"run_dir": str(run_dir), "job_id": jid,
                                                     "nodes": submission.extra.get("nodes")})

    # -------------------------------------------------------------- state
    def query(self, handle: JobHandle) -> dict:
        """{'state', 'terminal', 'slurm_state', 'reason', 'exit_code', 'restarts', 'nodelist'} from scontrol,
        else sacct (after the controller forgot the job)."""
        jid = job_id_of(handle)
        r = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and "JobState=" in r.stdout:
            kv = parse_kv(r.stdout)
            state, terminal, base = map_state(kv.get("JobState", ""))
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

    def status(self, handle: JobHandle) -> str:
        q = self.query(handle)
        return q["state"] if q["state"] == q["slurm_state"] else f"{q['state']} ({q['slurm_state']})"

    def cancel(self, handle: JobHandle) -> None:
        jid = job_id_of(handle)
        if shutil.which("scancel") is None:
            raise ConfigError(Problem(f"cluster {self._name!r}", "scancel not found on PATH"))
        r = subprocess.run(["scancel", jid], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise LaunchError(f"scancel {jid} failed", argv=["scancel", jid], exit_code=r.returncode,
                              stderr_tail=r.stderr[-1000:])

    # -------------------------------------------------------------- logs and waiting
    def _run_dir(self, handle: JobHandle) -> Path:
        rd = handle.data.get("run_dir")
        if not rd:
            raise ConfigError(Problem("job", f"{handle.uri}: run directory unknown"))
        return Path(rd)

    def logs(self, handle: JobHandle, node_rank: int | None = None) -> Iterator[str]:
        run_dir = self._run_dir(handle)
        files = sorted((run_dir / "logs").glob("node*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
        for f in files:
            r = int(re.sub(r"\D", "", f.stem) or 0)
            if node_rank is not None and r != node_rank:
                continue
            host = _agent_host(run_dir, r)
            for line in f.read_text(errors="replace").splitlines():
                yield f"[{host} node{r}] {line}"

    def wait(self, handle: JobHandle, on_line: Callable[[int, str], None] | None = None,
             timeout: float | None = None) -> JobResult:
        run_dir = self._run_dir(handle)
        offsets: dict[Path, int] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            q = self.query(handle)
            self._pump(run_dir, offsets, on_line)
            if q["terminal"]:
                time.sleep(0.2)
                self._pump(run_dir, offsets, on_line)
                return self.result(handle, q)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{handle.uri} still {q['slurm_state']} after {timeout} s")
            time.sleep(self.poll)

    def _pump(self, run_dir: Path, offsets: dict[Path, int], on_line) -> None:
        if on_line is None:
            return
        for f in sorted((run_dir / "logs").glob("node*.log")):
            r = int(re.sub(r"\D", "", f.stem) or 0)
            try:
                with open(f, "rb") as fh:
                    fh.seek(offsets.get(f, 0))
                    data = fh.read()
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1
            offsets[f] = offsets.get(f, 0) + cut
            for line in data[:cut].decode(errors="replace").splitlines():
                if line.strip():
                    on_line(r, line)

    def result(self, handle: JobHandle, q: dict | None = None) -> JobResult:
        q = q or self.query(handle)
        run_dir = self._run_dir(handle)
        nodes = node_exits(run_dir, int(handle.data.get("nodes") or 0))
        rc = _slurm_exit(q["exit_code"])
        if q["state"] == "COMPLETED":
            return JobResult("COMPLETED", 0, "", nodes)
        if q["state"] == "CANCELLED":
            return JobResult("CANCELLED", 130, f"SLURM job {job_id_of(handle)} was cancelled (scancel)", nodes)
        failed = sorted((n for n in nodes if n.returncode not in (None, 0)),
                        key=lambda n: _exit_time(run_dir, n.node_rank))
        base = q["slurm_state"]
        head = f"SLURM job {job_id_of(handle)} {base}"
        if base in WHY:
            cause = f"{head}: the job {WHY[base]}"
            stops = [h for h in _history(run_dir) if h.get("decision") == "stop"]
            if stops:
                cause += f" ({stops[-1].get('reason')})"
        elif _hangs(run_dir, nodes):
            r, text = _hangs(run_dir, nodes)[0]
            cause = f"{head}: hang detected inside the allocation by node {r}: {text}; stacks in {run_dir}/stacks/"
        elif failed:
            from orchestrator.supervise import root_cause_text
            cause = f"{head}: {root_cause_text(failed[0])}"
        else:
            cause = f"{head} (exit {q['exit_code'] or '?'}, reason {q['reason'] or '-'}); see {run_dir}/logs/"
        return JobResult("FAILED", (failed[0].returncode if failed else rc) or 1, cause, nodes)


# ---------------------------------------------------------------------------------- run dir facts

def _agent_host(run_dir: Path, rank: int) -> str:
    try:
        return json.loads((run_dir / "nodes" / str(rank) / "agent.json").read_text()).get("host") or "?"
    except (OSError, ValueError):
        return "?"


def _hangs(run_dir: Path, nodes) -> list[tuple[int, str]]:
    """(node, text) of every node agent that stopped its node on a hang; one that saw its rank stopped first."""
    out = []
    for n in nodes:
        try:
            text = json.loads((run_dir / "nodes" / str(n.node_rank) / "exit.json").read_text()).get("hang")
        except (OSError, ValueError):
            continue
        if text:
            out.append((n.node_rank, text))
    return sorted(out, key=lambda x: ("is stopped" not in x[1], x[0]))


def _exit_time(run_dir: Path, rank: int) -> float:
    try:
        return float(json.loads((run_dir / "nodes" / str(rank) / "exit.json").read_text()).get("time") or 0)
    except (OSError, ValueError):
        return float("inf")


def _history(run_dir: Path) -> list[dict]:
    from orchestrator.launchers.slurm.task import restart_history
    return restart_history(run_dir)


def _slurm_exit(text: str) -> int:
    """'1:0' -> 1; '0:9' -> 128+9."""
    m = re.match(r"(\d+):(\d+)", text or "")
    if not m:
        return 1
    code, sig = int(m.group(1)), int(m.group(2))
    return 128 + sig if sig else code


def node_exits(run_dir: Path, nodes: int) -> tuple[NodeExit, ...]:
    out = []
    count = max(nodes, len(list((run_dir / "nodes").glob("*/agent.json"))) if (run_dir / "nodes").is_dir() else 0)
    for r in range(count):
        rc = sig = None
        try:
            ex = json.loads((run_dir / "nodes" / str(r) / "exit.json").read_text())
            rc, sig = ex.get("returncode"), ex.get("signal")
        except (OSError, ValueError):
            pass
        tail = ""
        try:
            tail = "\n".join((run_dir / "logs" / f"node{r}.log").read_text(errors="replace").splitlines()[-40:])
        except OSError:
            pass
        out.append(NodeExit(node_rank=r, host=_agent_host(run_dir, r), returncode=rc, signal=sig, log_tail=tail))
    return tuple(out)


def read_job_id(run_dir: str | os.PathLike) -> str | None:
    try:
        return Path(run_dir, "slurm_job_id").read_text().strip() or None
    except OSError:
        return None

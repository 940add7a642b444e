"""The run directory of a job: every path, every record, one writer each (submitit's `JobPaths` is the model).

```
RUN_DIR/plan.json                    LaunchPlan (written by the submitter)
RUN_DIR/recipe.yaml                  the resolved recipe (submitter)
RUN_DIR/cluster.json, handle.json    the cluster spec and the backend's handle (submitter; cancel/status from
                                     another process rebuild the launcher from them)
RUN_DIR/cancel.json                  a cancel request (from orchestrate cancel), read by the supervisor
RUN_DIR/restarts.jsonl               one AttemptRecord per restart decision (supervisor, or the SLURM task)
RUN_DIR/notify.log                   one line per notification delivered or failed, URLs masked (submitter)
RUN_DIR/resumed_from.json            {path, job, step}: another job's checkpoint this job began from, because its
                                     checkpoint.resume asked for it (submitter; orchestrator.core.resume)
RUN_DIR/job.sbatch, slurm_job_id     SLURM only
RUN_DIR/nodes/<R>/accelerate.yaml    node R's accelerate config (node agent, at launch)
RUN_DIR/nodes/<R>/command.txt        what node R runs, env with secrets masked (submitter, for humans)
RUN_DIR/nodes/<R>/agent.json         AgentRecord: pids, groups, host, launch token (node agent)
RUN_DIR/nodes/<R>/exit.json          ExitRecord: how node R's launch ended and why (node agent)
RUN_DIR/nodes/<R>/gpu_watch.json     GpuWatchRecord: node R's GPU watch during the job, its findings and warnings
                                     (node agent, orchestrator.node.gpuwatch)
RUN_DIR/nodes/<R>/output/rank<G>     named pipe: rank G's stdout+stderr, tagged `[rankG]: ` by the node agent
                                     (node.ranklines; opened by the rank's start-up hook; exists during the launch)
RUN_DIR/logs/node<R>.log             node R's output (the backend)
RUN_DIR/heartbeats/rank<G>.jsonl     per-rank heartbeat records, docs/CONTRACT.md (the ranks)
RUN_DIR/heartbeats/rank<G>.exit      {"pid", "code"}: how rank G left Python's exit (its start-up hooks; removed
                                     by the node agent before each launch)
RUN_DIR/stacks/rank<G>.txt           py-spy stacks of a hung job's ranks (node agent / supervisor)
RUN_DIR/tracking.json                {"mlflow": {"run_id", "experiment_id", "tracking_uri", "t"}}: the job's one
                                     MLflow run, as rank 0 named it (supervisor, from its "tracking" heartbeat)
RUN_DIR/hangs/ask_rank<G>            named pipe: a byte asks rank G's hang responder for its evidence (the rank's
                                     start-up hooks make it; orchestrate_hangs)
RUN_DIR/hangs/rank<G>.json           rank G's hang evidence: flight-recorder entries, thread stacks (the rank)
RUN_DIR/hangs/rank<G>.status.json    {"pid", "status": answered | stopped | no_answer, "asked"} (node.hangevidence)
RUN_DIR/diagnosis.json               the hang's analysis (core.hangs): root cause, culprits, the collective, stack
                                     classes, each rank's last collectives (the supervisor / the SLURM verdict node)
RUN_DIR/outcome.json                 how the job's last attempt ended, per node, as judged: {"state", "exit_code",
                                     "signal", "root_cause", "by", "t", "nodes": [{"node", "host", "end",
                                     "exit_code", "signal", "note"}], "teardown_at": when the supervisor told the
                                     nodes to stop, or null} (the supervising process, or the `status`
                                     that recorded the end of a job nobody supervised)
```

Paths in the plan are relative to the run dir (`RUN_DIR_VAR`), bound here (`bind`), so nothing is rewritten
on a node whose run dir sits elsewhere. Every write is atomic (temp file + rename) and owner-only (0600 files,
0700 directories). Readers get typed, frozen records with one default for every missing field.
Standard library only: it runs on every node.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from orchestrator.core.jobplan import RUN_DIR_VAR  # the plan's paths start with it; `RunDir.bind` binds it


def _from(cls, data: Any):
    """Build a record from a dict, ignoring unknown keys and keeping the class defaults for missing ones."""
    if not isinstance(data, dict):
        return None
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError:
        return None


@dataclass(frozen=True)
class AgentRecord:
    """nodes/<R>/agent.json: what a node agent started (written once, when the launch has started)."""

    node_rank: int
    host: str = ""
    agent_pid: int = 0
    agent_pgid: int = 0
    pid: int = 0  # the launch (`accelerate launch`) process; it leads its own group
    pgid: int = 0
    main_ip: str = ""
    started: float = 0.0
    agent_proc_start: float | None = None
    proc_start: float | None = None  # when the launch process started (its group's leader): pid reuse is told apart
    token: str = ""  # ORCHESTRATE_JOB_TOKEN of every process of the launch (ranks live in sessions of their own)
    container: str = ""  # the name of the node's podman/docker container ("" without one): removed by teardown
    runtime: str = ""  # the container runtime ("" without a container)

    def groups(self) -> list[int]:
        """The launch's and the agent's process groups, leaving out one whose id now belongs to an unrelated group
        (its leader ended and the id was handed out again: proctools.group_is_ours)."""
        from orchestrator.node.proctools import group_is_ours
        leaders = ((self.pgid, self.proc_start),  # the launch leads its group; the agent may not lead its own
                   (self.agent_pgid, self.agent_proc_start if self.agent_pgid == self.agent_pid else None))
        return [g for g, start in leaders if isinstance(g, int) and g > 1 and group_is_ours(g, start)]


@dataclass(frozen=True)
class ExitRecord:
    """nodes/<R>/exit.json: how a node's launch ended (written once, by its agent, when everything is gone)."""

    returncode: int  # what the node reports: 0 = done (or preempted after saving), else the failure
    time: float = 0.0  # wall clock when the launch had ended
    signal: int | None = None  # the launch died of this signal
    launch_returncode: int | None = None  # the raw code of `accelerate launch`
    stop_reason: str = ""  # why the agent stopped the launch ("" = it ended by itself)
    preempted: bool = False  # every rank saved a checkpoint on a preemption signal and stopped
    hang: str | None = None  # the agent's own hang verdict (SLURM: in-allocation monitor)
    rank_death: str | None = None  # "rank 1 (pid N) died of SIGKILL (exit -9) before finishing"
    host: str = ""  # the host the agent ran on (a node refused before its launch has no agent.json to say so)
    gpu_fault: str | None = None  # the GPU watch ended the node: "XID 79 (...) on GPU 1 of gpu02" (node.gpuwatch)
    unwritten: str = ""  # only in the copy an agent printed (EXIT_MARK) because this file could not be written: why

    def end(self) -> str:
        """How the node ended by its agent's own word (orchestrator.types.NODE_ENDS): hung, stopped (told to stop and
        no rank of its own died), preempted, done, failed. The supervisor's judgement (outcome.json) refines it."""
        if self.hang:
            return "hung"
        if self.stop_reason and not self.rank_death:
            return "stopped"
        return "preempted" if self.preempted else "done" if self.returncode == 0 else "failed"

    def note(self) -> str:
        return self.rank_death or self.gpu_fault or self.hang or self.stop_reason or (
            f"exit record could not be written: {self.unwritten}" if self.unwritten else "")


@dataclass(frozen=True)
class GpuWatchRecord:
    """nodes/<R>/gpu_watch.json: the node's GPU watch (orchestrator.node.gpuwatch), rewritten by its agent each poll."""

    host: str = ""
    every_s: float = 0.0  # health.gpu_watch_s
    since: float = 0.0  # the watch's start on the node's monotonic clock (XIDs stamped before it are not the job's)
    used: list[int] | None = None  # the GPUs watched (None: every GPU of the node)
    polls: int = 0
    t: float = 0.0  # wall clock of the last poll
    findings: list[str] = field(default_factory=list)  # every new finding seen, host and GPU named
    warnings: list[str] = field(default_factory=list)  # said once each: kernel log unreadable, throttling, ...
    fault: str | None = None  # the finding that ended the attempt

    def with_(self, **changes: Any) -> "GpuWatchRecord":
        from dataclasses import replace
        return replace(self, **changes)


@dataclass(frozen=True)
class AttemptRecord:
    """One line of restarts.jsonl: a decision to restart (or not) after an attempt ended."""

    t: float
    attempt: int  # the attempt that just ended (0 = the first run)
    decision: str  # restart | stop
    reason: str  # why the attempt ended, and why this decision
    step: int | None = None  # the furthest global step reached so far
    by: str = "supervisor"  # supervisor | slurm-requeue
    slurm_job_id: str = ""
    host: str = ""  # the host the attempt's failure is attributable to ("" when none is)
    kind: str = ""  # how: lost | health | crash | hang | straggler
    exclude: str = ""  # the host this decision takes out of the job (the next attempt runs without it)


STEP_TAIL = 16 << 10  # bytes of each rank's heartbeat file that furthest_step reads (~80 records)


EXIT_MARK = "ORCHESTRATE_EXIT "  # an agent that could not write its exit record prints it as one line of its output
RESERVE = ".exit.reserve"  # nodes/<R>/.exit.reserve: room an agent keeps for its exit record (write_exit_reserved)
RESERVE_BYTES = 64 << 10


def parse_exit_line(line: str) -> "ExitRecord | None":
    """The ExitRecord an agent printed (EXIT_MARK + JSON) instead of writing it, or None for any other line."""
    if not line.startswith(EXIT_MARK):
        return None
    try:
        return parse_exit(json.loads(line[len(EXIT_MARK):]))
    except ValueError:
        return None


class RunDir:
    """One job's run directory; `RunDir(path)` names it, nothing is created until something is written."""

    PLAN, RECIPE, CLUSTER, HANDLE, CANCEL = "plan.json", "recipe.yaml", "cluster.json", "handle.json", "cancel.json"
    RESTARTS, SBATCH, SLURM_JOB_ID, NOTIFY = "restarts.jsonl", "job.sbatch", "slurm_job_id", "notify.log"
    LOGS, HEARTBEATS, STACKS, NODES = "logs", "heartbeats", "stacks", "nodes"
    QUEUE = "queue.json"  # while the job waits for leased hosts / GPUs (QUEUED): what it waits for, since when
    STRAGGLERS = "stragglers.json"  # the supervisor's straggler verdicts and each rank's evidence (core.health)
    RESUMED = "resumed_from.json"  # another job's checkpoint this job began from, as asked (api.check_resume)
    HANGS = "hangs"  # hang evidence (node.hangevidence; the ranks' responder: hooks/orchestrate_hangs.DIR)
    DIAGNOSIS = "diagnosis.json"  # the hang's analysis (core.hangs), kept by node.hangevidence.diagnose_run
    OUTCOME = "outcome.json"  # the last attempt's end as judged, per node (supervisor / reconciling status)
    TRACKING = "tracking.json"  # the job's tracker run (MLflow), as rank 0 named it in a "tracking" heartbeat record

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # ----------------------------------------------------------------------------------- relative paths
    @staticmethod
    def node_rel(rank: int, name: str) -> str:
        return f"nodes/{rank}/{name}"

    @staticmethod
    def log_rel(rank: int) -> str:
        return f"logs/node{rank}.log"

    @staticmethod
    def heartbeat_rel(rank: int) -> str:
        return f"heartbeats/rank{rank}.jsonl"

    # ----------------------------------------------------------------------------------- paths
    @staticmethod
    def hang_ask_rel(rank: int) -> str:
        return f"{RunDir.HANGS}/ask_rank{rank}"

    @staticmethod
    def hang_evidence_rel(rank: int) -> str:
        return f"{RunDir.HANGS}/rank{rank}.json"

    @staticmethod
    def hang_status_rel(rank: int) -> str:
        return f"{RunDir.HANGS}/rank{rank}.status.json"

    def diagnosis(self) -> dict:
        data = self._json(self.DIAGNOSIS)
        return data if isinstance(data, dict) else {}

    def path(self, rel: str) -> Path:
        return self.root / rel

    def node_dir(self, rank: int) -> Path:
        return self.root / self.NODES / str(rank)

    def accelerate_config(self, rank: int) -> Path:
        return self.path(self.node_rel(rank, "accelerate.yaml"))

    def rank_pipes(self, rank: int) -> Path:
        """Node `rank`'s per-rank output pipes (`output/rank<G>`; hooks/sitecustomize.py spells the same path)."""
        return self.node_dir(rank) / "output"

    def agent_file(self, rank: int) -> Path:
        return self.path(self.node_rel(rank, "agent.json"))

    def exit_file(self, rank: int) -> Path:
        return self.path(self.node_rel(rank, "exit.json"))

    def log(self, rank: int) -> Path:
        return self.path(self.log_rel(rank))

    @property
    def heartbeats(self) -> Path:
        return self.root / self.HEARTBEATS

    @property
    def stacks(self) -> Path:
        return self.root / self.STACKS

    def bind(self, argv) -> list[str]:
        """The plan's argv with RUN_DIR_VAR replaced by this run dir (the one place a plan path is bound)."""
        return [a.replace(RUN_DIR_VAR, str(self.root)) for a in argv]  # also inside `--opt=${RUN_DIR}/x`

    # ----------------------------------------------------------------------------------- writing
    def mkdir(self, rel: str = "") -> Path:
        d = self.root / rel if rel else self.root
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            try:
                m.mkdir(mode=0o700)
            except FileExistsError:
                pass
        for m in missing or ([d] if d == self.root else []):
            try:
                os.chmod(m, 0o700)
            except OSError:
                pass
        return d

    def write_text(self, rel: str, text: str) -> Path:
        """Atomic, owner-only write of one file of the run dir."""
        path = self.root / rel
        self.mkdir(str(Path(rel).parent) if Path(rel).parent != Path(".") else "")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def write_json(self, rel: str, data: Any) -> Path:
        return self.write_text(rel, json.dumps(data, sort_keys=True, default=str) + "\n")

    def append_line(self, rel: str, line: str) -> None:
        self.mkdir(str(Path(rel).parent))
        fd = os.open(self.root / rel, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line.rstrip("\n") + "\n").encode())
        finally:
            os.close(fd)

    def write_files(self, files: dict[str, str]) -> None:
        for rel, text in sorted(files.items()):
            self.write_text(rel, text)

    def write_agent(self, rec: AgentRecord) -> None:
        self.write_json(self.node_rel(rec.node_rank, "agent.json"), asdict(rec))

    def write_exit(self, rank: int, rec: ExitRecord) -> None:
        self.write_json(self.node_rel(rank, "exit.json"), asdict(rec))

    def write_gpu_watch(self, rank: int, rec: GpuWatchRecord) -> None:
        self.write_json(self.node_rel(rank, "gpu_watch.json"), asdict(rec))

    def gpu_watch(self, rank: int) -> GpuWatchRecord | None:
        return _from(GpuWatchRecord, self._json(self.node_rel(rank, "gpu_watch.json")))

    def forget_attempt(self, rank: int) -> None:
        """Drop node `rank`'s agent and exit records of an earlier attempt (records are per attempt): a new agent does
        this first, so one that dies before writing its own leaves nothing that speaks for it (the submitter, whose
        run dir may not be the node's, drops its own copies too)."""
        for path in (self.exit_file(rank), self.agent_file(rank)):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    def reserve_exit(self, rank: int) -> None:
        """Keep room for node `rank`'s exit record (RESERVE_BYTES in nodes/<R>/.exit.reserve): a filesystem that
        fills up while the job runs (a full ORCHESTRATE_HOME) still takes the record at the end. Best effort."""
        path = self.node_dir(rank) / RESERVE
        try:
            self.mkdir(str(path.parent.relative_to(self.root)))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            path.unlink(missing_ok=True)

    def write_exit_reserved(self, rank: int, rec: ExitRecord) -> str | None:
        """write_exit, then (no space) again after giving back the reserved room; never raises: returns why the
        record could not be written (None: written). The reserve goes in any case."""
        reserve = self.node_dir(rank) / RESERVE
        why = None
        for _ in range(2):
            try:
                self.write_exit(rank, rec)
                why = None
                break
            except OSError as e:
                why = write_error(e)
                try:
                    reserve.unlink()
                except OSError:
                    break  # nothing left to give back
        try:
            reserve.unlink(missing_ok=True)
        except OSError:
            pass
        return why

    def append_attempt(self, rec: AttemptRecord) -> None:
        self.append_line(self.RESTARTS, json.dumps(asdict(rec), sort_keys=True))

    def write_outcome(self, outcome: dict) -> str | None:
        """Record the judged end (OUTCOME). Never raises: returns why it could not be written (a full disk), else
        None."""
        try:
            self.write_json(self.OUTCOME, outcome)
        except OSError as e:
            return write_error(e)
        return None

    def outcome(self) -> dict:
        data = self._json(self.OUTCOME)
        return data if isinstance(data, dict) else {}

    def excluded(self) -> dict[str, str]:
        """Hosts taken out of the job, with why (from restarts.jsonl, and the pre-flight's replacements)."""
        out = {a.exclude: a.reason for a in self.attempts() if a.exclude}
        return out

    def stragglers(self) -> dict:
        """stragglers.json: {"named": [Straggler.to_dict() + "t", "attempt", "action"], "evidence": {rank: s},
        "t"}; {} when nothing was judged."""
        data = self._json(self.STRAGGLERS)
        return data if isinstance(data, dict) else {}

    def write_tracking(self, rec: dict) -> bool:
        """Keep the tracker run that rank 0's "tracking" heartbeat record names (orchestrate_tracking), as
        {tracker: {"run_id", "experiment_id", "tracking_uri", "t"}}; written only when it changes (True: written).
        Never raises."""
        tracker = str(rec.get("tracker") or "")
        entry = {k: rec.get(k) for k in ("run_id", "experiment_id", "tracking_uri")}
        data = self.tracking()
        if not tracker or not entry["run_id"] or {k: (data.get(tracker) or {}).get(k) for k in entry} == entry:
            return False
        data[tracker] = dict(entry, t=rec.get("t"))
        try:
            self.write_json(self.TRACKING, data)
        except OSError:
            return False
        return True

    def tracking(self) -> dict:
        """{tracker: {"run_id", "experiment_id", "tracking_uri", "t"}}: the job's tracker runs; {} when none."""
        data = self._json(self.TRACKING)
        return data if isinstance(data, dict) else {}

    def request_cancel(self, by: str) -> None:
        self.write_json(self.CANCEL, {"by": by, "t": time.time()})

    # ----------------------------------------------------------------------------------- reading
    def _json(self, rel: str) -> Any:
        try:
            return json.loads((self.root / rel).read_text())
        except (OSError, ValueError):
            return None

    def read_plan(self):
        from orchestrator.core.jobplan import LaunchPlan
        return LaunchPlan.from_json((self.root / self.PLAN).read_text())

    def read_json(self, rel: str) -> Any:
        return self._json(rel)

    def agent(self, rank: int) -> AgentRecord | None:
        return parse_agent(self._json(self.node_rel(rank, "agent.json")))

    def exit(self, rank: int) -> ExitRecord | None:
        return parse_exit(self._json(self.node_rel(rank, "exit.json")))

    def node_ranks(self) -> list[int]:
        d = self.root / self.NODES
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []

    def agents(self) -> dict[int, AgentRecord]:
        out = {}
        for r in self.node_ranks():
            a = self.agent(r)
            if a is not None:
                out[r] = a
        return out

    def cancel_request(self) -> dict | None:
        d = self._json(self.CANCEL)
        return d if isinstance(d, dict) else None

    def attempts(self) -> list[AttemptRecord]:
        out = []
        try:
            text = (self.root / self.RESTARTS).read_text()
        except OSError:
            return out
        for line in text.splitlines():
            try:
                rec = _from(AttemptRecord, json.loads(line))
            except ValueError:
                continue
            if rec is not None:
                out.append(rec)
        return out

    def log_tail(self, rank: int, lines: int = 60) -> str:
        try:
            with open(self.log(rank), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                data = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(data.replace("\r", "\n").splitlines()[-lines:])

    def iter_log(self, rank: int) -> Iterator[str]:
        try:
            with open(self.log(rank), errors="replace") as fh:
                for line in fh:
                    yield line.rstrip("\n")
        except OSError:
            return

    def log_ranks(self) -> list[int]:
        d = self.root / self.LOGS
        out = []
        for p in d.glob("node*.log") if d.is_dir() else []:
            try:
                out.append(int(p.stem[4:]))
            except ValueError:
                continue
        return sorted(out)

    def restarts(self) -> int:
        """Every restart, whoever decided it (the submitter's supervisor, or a SLURM requeue inside the allocation)."""
        return sum(1 for a in self.attempts() if a.decision == "restart")

    def furthest_step(self, tail_bytes: int = STEP_TAIL) -> int | None:
        """The highest global step any rank reported lately (restart progress: the latest attempt's furthest step),
        from the last `tail_bytes` of each heartbeat file: bounded by the job's size, not its history (a restart of
        8,192 ranks reads 128 MiB, not every record they ever wrote); `ls` reads 512 bytes of each."""
        best = None
        d = self.heartbeats
        for f in d.glob("rank*.jsonl") if d.is_dir() else []:  # (a max: any order)
            try:
                with open(f, "rb") as fh:
                    size = fh.seek(0, os.SEEK_END)
                    fh.seek(max(0, size - tail_bytes))
                    lines = fh.read().decode(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines[1:] if size > tail_bytes else lines:  # (a partial first line left out)
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int) and (best is None or step > best):
                    best = step
        return best


def write_error(e: OSError) -> str:
    """Why a record could not be written, in words: `no space left on device`, `disk quota exceeded`, ..."""
    import errno
    what = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded (no space left on device)"
            }.get(e.errno or 0) or e.strerror or str(e)
    return f"{e.filename}: {what}" if e.filename else what


def parse_agent(data: Any) -> AgentRecord | None:
    return _from(AgentRecord, data) if isinstance(data, dict) and isinstance(data.get("node_rank"), int) else None


def parse_exit(data: Any) -> ExitRecord | None:
    return _from(ExitRecord, data) if isinstance(data, dict) and isinstance(data.get("returncode"), int) else None

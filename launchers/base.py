"""The Launcher protocol: the one every backend implements and the only one the api uses.

- `prepare(plan) -> Submission`: pure. Exactly what runs (each node agent's argv, files, backend extras);
  `render` / `submit --dry-run` print it.
- `submit(submission, run_dir, cancel) -> Running`: starts it; the returned object reports events (the vocabulary
  of `orchestrator.events`) to the one `orchestrator.supervise.Supervisor` and acts when told (stop, hang
  diagnosis). Backends observe and report; they decide nothing (they never import the supervisor). `cancel` (the
  supervisor's event) is set when the user cancels during the start: a backend
  whose start can take long (SSH: staging, connecting, the hosts' pre-flight) stops waiting within a poll, leaves
  nothing started and raises `SubmitCancelled`; one whose start is immediate (local, SLURM's sbatch) may ignore
  it, the supervisor then stops the job as soon as it has it.
- `status(handle, run_dir) -> JobStatus`, `cancel(handle, run_dir)`, `logs(handle, run_dir, node)`: from any
  process, rebuilt from the store's record (the run dir's cluster.json and handle.json).

A backend never builds shell strings from user data except at its single remote boundary (shlex.quote there).
"""

from __future__ import annotations

import threading
from typing import Iterator, Protocol

from orchestrator.core.jobplan import LaunchPlan
from orchestrator.errors import Problem
from orchestrator.events import Running
from orchestrator.node.rundir import RunDir, parse_exit
from orchestrator.types import JobHandle, JobState, JobStatus, NodeStatus, Submission


class Launcher(Protocol):
    kind: str

    def prepare(self, plan: LaunchPlan) -> Submission: ...

    def submit(self, submission: Submission, run_dir: RunDir, cancel: threading.Event | None = None) -> Running: ...

    def status(self, handle: JobHandle, run_dir: RunDir) -> JobStatus: ...

    def cancel(self, handle: JobHandle, run_dir: RunDir) -> None: ...

    def logs(self, handle: JobHandle, run_dir: RunDir, node: int | None = None) -> Iterator[str]: ...


def run_dir_logs(run_dir: RunDir, node: int | None = None, hosts: dict[int, str] | None = None) -> Iterator[str]:
    """Every backend keeps each node's output in RUN_DIR/logs/node<R>.log on the submit host: `[host nodeR rankG] line`
    for a rank's line, `[host nodeR] line` for the launcher's or the agent's (orchestrator.node.ranklines)."""
    from orchestrator.node.ranklines import show
    ranks = [node] if node is not None else run_dir.log_ranks()
    for r in ranks:
        host = (hosts or {}).get(r) or (run_dir.agent(r).host if run_dir.agent(r) else "") or "?"
        for line in run_dir.iter_log(r):
            yield show(host, r, line)


def status_from_nodes(rows: list[dict], unreachable: dict[int, str] | None = None) -> JobStatus:
    """A job's status from its agents' own words (orchestrator.node.ops.node_status rows, read locally or over SSH):
    a node is exited (its ExitRecord), running (its agent lives), lost (agent gone without a record) or unknown
    (its host did not answer). RUNNING while any node runs or cannot be asked; else judged from the exit records."""
    nodes = [NodeStatus(r, "", "unknown", None, why) for r, why in sorted((unreachable or {}).items())]
    for row in rows:
        ex, r, host = row.get("exit"), int(row["node_rank"]), row.get("host") or ""
        rec = parse_exit(ex)
        if rec is not None:
            nodes.append(NodeStatus(r, host, "exited", rec.returncode, rec.note(), rec.end()))
        elif row.get("agent_alive"):
            nodes.append(NodeStatus(r, host, "running"))
        else:
            why = "agent gone without an exit record" if row.get("recorded") else "no agent recorded"
            nodes.append(NodeStatus(r, host, "lost" if row.get("recorded") else "unknown", None, why,
                                    "lost" if row.get("recorded") else ""))
    nodes.sort(key=lambda n: n.node_rank)
    if not nodes or any(n.state in ("running", "unknown") for n in nodes):
        return JobStatus(JobState.RUNNING, tuple(nodes), "" if nodes else "no node recorded yet")
    if all(n.state == "exited" and n.returncode == 0 for n in nodes):
        return JobStatus(JobState.COMPLETED, tuple(nodes))
    return JobStatus(JobState.FAILED, tuple(nodes), "no node of the job is running")


# ------------------------------------------------------------------ containers (docs/containers.md)

CONTAINER_FILE = "container.json"


def container_problems(image: str, checks: dict[str, dict]) -> list[Problem]:
    """Each host's container pre-flight (orchestrator.node.containers.preflight) as problems: the host's own, then
    the stack's versions inside the image, which must agree across hosts (the version-skew rule, in the image)."""
    problems = [Problem(host, why) for host, res in checks.items() for why in res.get("problems", [])]
    if problems or len(checks) < 2:
        return problems
    first, *rest = list(checks)
    want = checks[first].get("versions") or {}
    for host in rest:
        have = checks[host].get("versions") or {}
        for name in sorted(set(want) | set(have)):
            if have.get(name) != want.get(name):
                problems.append(Problem(host, f"in container image {image}: {name} {have.get(name) or 'missing'} "
                                              f"differs from {first}'s {want.get(name) or 'missing'}"))
    return problems


def record_container(run_dir: RunDir, container: dict, checks: dict[str, dict]) -> None:
    """RUN_DIR/container.json: the image reference, the runtime and, per host, the image's id and digest and the
    stack's versions in it (what `status --json` shows)."""
    hosts = {h: {"image": r.get("image") or {}, "versions": r.get("versions") or {}} for h, r in sorted(checks.items())}
    run_dir.write_json(CONTAINER_FILE, {"runtime": container.get("runtime"), "image": container.get("image"),
                                        "hosts": hosts})


FDS_PER_NODE = 3  # what the submitting process keeps open per node (measured 2: SSH its connection and the node's
FDS_SPARE = 64  # log; local its agent's output pipe and log) and what it needs besides


def ensure_open_files(nodes: int, what: str, limit: tuple[int, int] | None = None) -> str:
    """Room for a job's open files in this process (FDS_PER_NODE per node + FDS_SPARE): the soft RLIMIT_NOFILE is
    raised up to the hard limit when it is lower (the default soft limit, 1,024, holds ~320 nodes), and the raise is
    returned as one line to say; PreflightError, nothing started, when even the hard limit is too low. `limit`:
    (soft, hard) instead of this process's (tests)."""
    import resource
    from orchestrator.errors import PreflightError
    need = FDS_PER_NODE * nodes + FDS_SPARE
    soft, hard = limit or resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return ""
    if hard != resource.RLIM_INFINITY and hard < need:
        raise PreflightError(Problem("open files", f"{what} of {nodes} nodes needs about {need} open files in the "
                                     f"submitting process, but its limit is {soft} (hard limit {hard}): raise it "
                                     f"(`ulimit -n {need}`, or nofile in /etc/security/limits.conf) and submit again"))
    if limit is None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return f"raised this process's open-files limit from {soft} to {need} for {what} of {nodes} nodes"

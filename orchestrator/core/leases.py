"""Leases on hosts and GPUs: what a job's node must hold while it runs, written once (pure; docs/CONTRACT.md "Leases").

Two jobs must never share a host's GPUs nor, for a whole-host job, the host; two submitters with different job stores
(two users) must not either, so the lease lives ON THE HOST: the node agent (orchestrator.node.lease) takes `flock`s
on files in LEASE_DIR for the life of its job; the kernel drops them when the agent dies. The scheme per host H:

- `host-H.lock`: taken EXCLUSIVE by a job that uses the whole host (a CPU job, or all of a host's GPUs: the plan binds
  no CUDA_VISIBLE_DEVICES), SHARED by a job that uses some GPUs by index;
- `host-H.gpuN.lock`: taken EXCLUSIVE by a job whose node binds GPU N (the plan's CUDA_VISIBLE_DEVICES).

So GPU-subset jobs on disjoint GPUs run side by side, a whole-host job waits for every one of them (and they for it).
H is the host as the plan names it: the project's testbeds run several "hosts" on one machine (loopback addresses),
which must not block each other. Which backends lease: SSH (always), local (GPU jobs only: CPU-only local jobs do not
collide, each gets a free port), SLURM never (the scheduler allocates). A lock file holds its holder as one JSON line
(`holder`): job id, submitting user@host, agent pid, since.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

from orchestrator.errors import LeasesBusy

LEASE_DIR = "/tmp/orchestrate-leases"  # per host, every user: the directory is 1777, lock files 0666
LEASE_DIR_VAR = "ORCHESTRATE_LEASE_DIR"  # the node agent's override of LEASE_DIR (tests)
EXIT_BUSY = LeasesBusy.exit_code  # 75, EX_TEMPFAIL: `submit --no-wait` found a lease held; an agent that lost the race
LOCAL_HOST = "localhost"  # the local backend's one host


@dataclass(frozen=True)
class Lock:
    """One lock file: `name` in LEASE_DIR, taken `exclusive` or shared; `what` says it for humans."""

    name: str
    exclusive: bool
    what: str

    def to_list(self) -> list[Any]:
        return [self.name, self.exclusive, self.what]

    @classmethod
    def from_list(cls, x: Iterable[Any]) -> "Lock":
        name, exclusive, what = list(x)
        return cls(str(name), bool(exclusive), str(what))


def _safe(host: str) -> str:
    """A host name as a file name: [A-Za-z0-9._-] kept, anything else as %XX (no '/', no collisions)."""
    return re.sub(r"[^A-Za-z0-9._-]", lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), host) or "%"


def lock_name(host: str, gpu: int | None = None) -> str:
    return f"host-{_safe(host)}.lock" if gpu is None else f"host-{_safe(host)}.gpu{int(gpu)}.lock"


def gpu_prefix(host: str) -> str:
    """The start of every GPU lock file's name of `host` (who holds the host's shared lock)."""
    return f"host-{_safe(host)}.gpu"


def node_locks(host: str, gpus: tuple[int, ...] | None) -> tuple[Lock, ...]:
    """The locks a node on `host` takes: the whole host (gpus None), or the host shared and each GPU exclusive."""
    if gpus is None:
        return (Lock(lock_name(host), True, f"host {host}"),)
    return (Lock(lock_name(host), False, f"host {host}"),) + tuple(
        Lock(lock_name(host, g), True, f"GPU {g} of {host}") for g in sorted(set(gpus)))


def node_gpus(env: dict[str, str]) -> tuple[int, ...] | None:
    """The GPUs a node binds by index (its planned CUDA_VISIBLE_DEVICES); None: it uses the whole host."""
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    ids = tuple(int(g) for g in text.split(",") if g.strip().isdigit())
    return ids if ids else None


def plan_locks(plan: Any, rank: int) -> tuple[Lock, ...]:
    """What node `rank` of `plan` (a jobplan.LaunchPlan) leases: SSH its host (or its GPUs), local its GPUs (a CPU job:
    nothing), SLURM nothing."""
    node = plan.node(rank)
    gpus = node_gpus(node.env) if plan.accelerator == "gpu" else None
    if plan.cluster_kind == "ssh":
        return node_locks(node.host, gpus)
    if plan.cluster_kind == "local" and gpus is not None:
        return node_locks(LOCAL_HOST, gpus)
    return ()


def lease_request(plan: Any, rank: int) -> dict[str, Any] | None:
    """The agent's lease for node `rank` as JSON (the SSH probe carries it; None: nothing to lease)."""
    locks = plan_locks(plan, rank)
    if not locks:
        return None
    host = plan.node(rank).host if plan.cluster_kind == "ssh" else LOCAL_HOST
    return {"host": host, "locks": [lk.to_list() for lk in locks], "job": plan.job_id,
            "submitter": getattr(plan, "submitter", "")}


def conflict(a: Iterable[Lock], b: Iterable[Lock]) -> bool:
    """Two nodes' (or jobs') locks cannot all be held at once: a common file that either takes exclusive."""
    mine = {lk.name: lk.exclusive for lk in a}
    return any(lk.name in mine and (lk.exclusive or mine[lk.name]) for lk in b)


def holder(job: str, submitter: str, pid: int, since: float, lock: str) -> dict[str, Any]:
    """The JSON a lock file holds while its lock is held."""
    return {"job": job, "submitter": submitter, "pid": pid, "since": since, "lock": lock}


def holder_text(h: dict[str, Any] | None) -> str:
    """`job J (user@host, agent pid P, since 12:03:04 UTC)`; the holder unknown while it is just being taken."""
    if not h or not h.get("job"):
        return "another job (holder not recorded yet)"
    parts = [p for p in (h.get("submitter") or "", f"agent pid {h['pid']}" if h.get("pid") else "") if p]
    since = h.get("since")
    if isinstance(since, (int, float)):
        parts.append("since " + time.strftime("%H:%M:%S UTC", time.gmtime(since)))
    return f"job {h['job']}" + (f" ({', '.join(parts)})" if parts else "")


def busy_text(busy: dict[str, Any]) -> str:
    """One line: what is leased and by whom (`busy`: {"host", "what", "holder"} as the agent reports it)."""
    what = busy.get("what") or f"host {busy.get('host', '?')}"
    return f"{what} is leased by {holder_text(busy.get('holder'))}"


def busy_error_text(busy: list[dict[str, Any]]) -> str:
    """The one line for every busy host (errors.LeasesBusy's message)."""
    return "; ".join(busy_text(b) for b in busy)


def queue_position(job: str, queued: list[tuple[str, float, tuple[Lock, ...]]]) -> int:
    """1 + the queued jobs submitted before `job` (FIFO by submit time, then id) whose locks conflict with its own.
    `queued`: (id, created, locks) of this store's QUEUED jobs, `job` among them."""
    me = next((q for q in queued if q[0] == job), None)
    if me is None:
        return 1
    return 1 + sum(1 for q in queued if q[0] != job and (q[1], q[0]) < (me[1], me[0]) and conflict(q[2], me[2]))


def job_locks(plan: Any) -> tuple[Lock, ...]:
    """Every lock the job's nodes take (a job conflicts with another when any of them do)."""
    return tuple(lk for r in range(plan.nodes) for lk in plan_locks(plan, r))

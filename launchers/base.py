"""The Launcher protocol (prepare / submit / wait / status / cancel / logs) and its small types.

`prepare` is pure: it turns a LaunchPlan into a printable `Submission` (the exact argv per node).
Everything with side effects happens in `submit` and after. A backend never builds shell strings
from user data except at its single remote boundary (shlex.quote there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from orchestrator.jobplan import LaunchPlan


@dataclass(frozen=True)
class NodeCommand:
    """How one node agent is started: on `host`, run `argv` with `env` added (secret names only
    are listed in `secret_env`; their values travel out of band)."""

    node_rank: int
    host: str
    argv: tuple[str, ...]
    env: dict[str, str]
    secret_env: tuple[str, ...] = ()


@dataclass(frozen=True)
class Submission:
    """What `submit` will do, printable and side-effect free."""

    kind: str
    run_dir: str
    nodes: tuple[NodeCommand, ...]
    files: dict[str, str] = field(default_factory=dict)  # relative path in run dir -> content
    extra: dict[str, Any] = field(default_factory=dict)  # backend specifics (e.g. sbatch script)


@dataclass(frozen=True)
class JobHandle:
    """Where a submitted job lives, e.g. local://<job_id>, ssh://<job_id>, slurm://1234."""

    uri: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeExit:
    node_rank: int
    host: str
    returncode: int | None  # None: still running or unknown
    signal: int | None = None
    log_tail: str = ""


@dataclass(frozen=True)
class JobResult:
    state: str  # COMPLETED | FAILED | CANCELLED
    returncode: int
    root_cause: str = ""
    nodes: tuple[NodeExit, ...] = ()
    max_step: int | None = None  # the furthest training step any rank reported (restart progress)
    hung: bool = False
    restarts: int = 0


class Launcher(Protocol):
    kind: str

    def prepare(self, plan: LaunchPlan) -> Submission: ...

    def submit(self, submission: Submission) -> JobHandle: ...

    def wait(self, handle: JobHandle, on_line: Callable[[int, str], None] | None = None) -> JobResult: ...

    def status(self, handle: JobHandle) -> str: ...

    def cancel(self, handle: JobHandle) -> None: ...

    def logs(self, handle: JobHandle, node_rank: int | None = None) -> Iterator[str]: ...

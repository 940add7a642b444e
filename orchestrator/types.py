"""Leaf types shared by the api, the supervisor, the backends and the CLI: job states, what a backend is asked
to run (`Submission`, `NodeCommand`), where a submitted job lives (`JobHandle`), and how it ended (`NodeExit`,
`JobResult`), plus the typed status a backend reports (`NodeStatus`, `JobStatus`). Imports nothing of ours.
"""

from __future__ import annotations

import enum
import signal as _signal
from dataclasses import dataclass, field
from typing import Any


class JobState(str, enum.Enum):
    """Every state a job record can be in. `terminal` is the one terminal set; the store writes nothing else."""

    PENDING = "PENDING"  # recorded, nothing started yet (or queued by the scheduler)
    QUEUED = "QUEUED"  # waits for hosts / GPUs another job leases (docs/CONTRACT.md "Leases"); nothing started
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"  # an attempt ended; the next starts from the last checkpoint
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


def is_terminal(state: str | JobState | None) -> bool:
    return state in {s.value for s in TERMINAL}


@dataclass(frozen=True)
class NodeCommand:
    """How one node agent is started: on `host`, run `argv` with `env` added (secret names only are listed in
    `secret_env`; their values travel on the agent's stdin)."""

    node_rank: int
    host: str
    argv: tuple[str, ...]
    env: dict[str, str]
    secret_env: tuple[str, ...] = ()


@dataclass(frozen=True)
class Submission:
    """Exactly what `submit` runs, printable and side-effect free (`render` / `--dry-run` show it)."""

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


def exit_signal(code: int | None) -> str | None:
    """The signal an exit code stands for in the shell's convention (128 + N: 137 = SIGKILL, 143 = SIGTERM; the
    one representation of a signal death in exit codes, docs/CONTRACT.md "Exit codes"), else None."""
    if code is None or not 128 < code < 128 + 65:
        return None
    try:
        return _signal.Signals(code - 128).name
    except ValueError:
        return None


def exit_text(code: int | None) -> str:
    """An exit code as shown: `3`, `137/SIGKILL`, `-` (none)."""
    if code is None:
        return "-"
    sig = exit_signal(code)
    return f"{code}/{sig}" if sig else str(code)


# How a node's part of an attempt ended, as the one supervisor judged it (RUN_DIR/outcome.json, `status`):
# done (ended well by itself), failed (a failure of its own: the root cause's node, or one that failed before the
# teardown), stopped (torn down by the supervisor or cancelled, whatever it exited with while stopping), hung (the
# node of the rank a hang names), preempted (saved on a preemption signal and stopped), lost (gone, no exit known).
NODE_ENDS = ("done", "failed", "stopped", "hung", "preempted", "lost")


@dataclass(frozen=True)
class NodeExit:
    node_rank: int
    host: str
    returncode: int | None  # None: still running or unknown; 128 + N: ended by signal N
    signal: int | None = None
    log_tail: str = ""
    end: str = ""  # one of NODE_ENDS ("" before the supervisor judged it)
    note: str = ""  # why, in a few words: the rank's death, the stop reason, why it is lost

    def to_dict(self) -> dict[str, Any]:
        """One node of RUN_DIR/outcome.json."""
        return {"node": self.node_rank, "host": self.host, "end": self.end, "exit_code": self.returncode,
                "signal": exit_signal(self.returncode), "note": self.note}


@dataclass(frozen=True)
class JobResult:
    state: JobState
    returncode: int
    root_cause: str = ""
    nodes: tuple[NodeExit, ...] = ()
    max_step: int | None = None  # the furthest training step any rank reported (restart progress)
    hung: bool = False
    restarts: int = 0
    # The host the failure is attributable to, and how (lost | health | crash | hang | straggler): what the restart
    # policy needs to take a bad host out of the job (docs/CONTRACT.md "Bad nodes"); "" when none is.
    culprit_host: str = ""
    culprit_kind: str = ""
    teardown_at: float | None = None  # wall time the supervisor told the nodes to stop (None: it never had to)


@dataclass(frozen=True)
class NodeStatus:
    """One node as a backend sees it now: `state` is running | exited | lost | unknown."""

    node_rank: int
    host: str
    state: str
    returncode: int | None = None
    reason: str = ""
    end: str = ""  # exited nodes: done | failed | stopped (its agent was told to stop), as in NODE_ENDS


@dataclass(frozen=True)
class JobStatus:
    """What `Launcher.status` reports: the job's state as the backend sees it, per node, and why."""

    state: JobState
    nodes: tuple[NodeStatus, ...] = ()
    reason: str = ""
    detail: str = ""  # backend words, e.g. "SLURM TIMEOUT"

"""The Launcher protocol (prepare / submit / wait / status / cancel / logs) and its small types.

`prepare` is pure: it turns a LaunchPlan into a printable `Submission` (the exact argv per node).
Everything with side effects happens in `submit` and after. A backend never builds shell strings
from user data except at its single remote boundary (shlex.quote there).
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

from orchestrator.core.jobplan import LaunchPlan
from orchestrator.types import JobHandle, JobResult, Submission


class Launcher(Protocol):
    kind: str

    def prepare(self, plan: LaunchPlan) -> Submission: ...

    def submit(self, submission: Submission) -> JobHandle: ...

    def wait(self, handle: JobHandle, on_line: Callable[[int, str], None] | None = None) -> JobResult: ...

    def status(self, handle: JobHandle) -> str: ...

    def cancel(self, handle: JobHandle) -> None: ...

    def logs(self, handle: JobHandle, node_rank: int | None = None) -> Iterator[str]: ...

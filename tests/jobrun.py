"""Run a job through a backend and the one supervisor, the way orchestrator.running.submit does, for tests that need
the running job in their hands (pids, signals) without the store: `started = start(launcher, plan, run_dir)`, then
`started.result(timeout)`; `run(...)` does both."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.node.rundir import RunDir
from orchestrator.supervise import Supervisor


@dataclass
class Started:
    supervisor: Supervisor
    running: object
    thread: threading.Thread
    box: dict = field(default_factory=dict)

    def result(self, timeout: float = 300):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the job did not end within {timeout}s"
        if "error" in self.box:
            raise self.box["error"]
        return self.box["result"]

    def cancel(self, reason: str = "cancelled by the test") -> None:
        self.supervisor.request_cancel(reason)


def start(launcher, plan, run_dir: str | Path | None = None, submission=None, lines: list | None = None,
          **supervisor_kw) -> Started:
    rd = RunDir(run_dir or plan.run_dir)
    running = launcher.submit(submission or launcher.prepare(plan), rd)
    on_line = (lambda r, line: lines.append((r, line))) if lines is not None else None
    sup = Supervisor(plan, on_line=on_line, **supervisor_kw)
    box: dict = {}

    def go() -> None:
        try:
            box["result"] = sup.run(running)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            box["error"] = e
    t = threading.Thread(target=go, daemon=True, name="test-supervisor")
    t.start()
    return Started(sup, running, t, box)


def run(launcher, plan, run_dir=None, submission=None, lines=None, timeout: float = 300, **kw):
    return start(launcher, plan, run_dir, submission, lines, **kw).result(timeout)


def watch(running, plan, lines: list | None = None, timeout: float = 300, **supervisor_kw):
    """Supervise an already submitted job (`launcher.submit(...)` returned `running`) to its end."""
    on_line = (lambda r, line: lines.append((r, line))) if lines is not None else None
    sup = Supervisor(plan, on_line=on_line, **supervisor_kw)
    box: dict = {}

    def go() -> None:
        try:
            box["result"] = sup.run(running)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e
    t = threading.Thread(target=go, daemon=True, name="test-supervisor")
    t.start()
    return Started(sup, running, t, box).result(timeout)

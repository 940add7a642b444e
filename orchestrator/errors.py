"""The error hierarchy: one root, one line each for the CLI.

`ConfigError` carries every problem found in the inputs (all reported together, exit code 2);
`LaunchError` carries where a launch failed (host, argv, exit code, stderr tail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class OrchestratorError(Exception):
    """Root of every error this tool raises on purpose. `exit_code` is what the CLI returns."""

    exit_code = 1

    def one_line(self) -> str:
        return str(self).splitlines()[0] if str(self) else type(self).__name__


@dataclass(frozen=True)
class Problem:
    """One bad input: where (a dotted key path, file:line, or a host) and what is wrong."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class ConfigError(OrchestratorError):
    """Bad input (recipe, cluster file, flags, overrides). Always exit code 2, nothing touched."""

    exit_code = 2

    def __init__(self, problems: list[Problem] | Problem | str, source: str | None = None):
        if isinstance(problems, (Problem, str)):
            problems = [problems if isinstance(problems, Problem) else Problem("", problems)]
        self.problems: list[Problem] = list(problems)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return f"{prefix}{self.problems[0]}"
        head = f"{prefix}{len(self.problems)} problems: " + "; ".join(str(p) for p in self.problems)
        return head

    def one_line(self) -> str:
        return self._render().replace("\n", " ")


class LaunchError(OrchestratorError):
    """A node or launcher failed to start or run."""

    exit_code = 1

    def __init__(self, message: str, *, host: str | None = None, argv: list[str] | None = None,
                 exit_code: int | None = None, stderr_tail: str = ""):
        self.host = host
        self.argv = list(argv or [])
        self.returncode = exit_code
        self.stderr_tail = stderr_tail
        where = f"{host}: " if host else ""
        super().__init__(f"{where}{message}")


class SubmitCancelled(OrchestratorError):
    """The user cancelled (Ctrl-C, `orchestrate cancel`) while the backend was still starting the job (staging,
    pre-flight): it stopped there, before any node started, and nothing of the job runs. Exit 130."""

    exit_code = 130


class LeasesBusy(OrchestratorError):
    """A host or GPU the job needs is leased by another job (docs/CONTRACT.md "Leases"): the job waits (QUEUED), or
    with `submit --no-wait` exits 75 (EX_TEMPFAIL) with this one line. `busy`: what each busy host reported
    ({"host", "lock", "what", "holder"}). `kept`: what the backend keeps open for the job's next look (SSH: each
    host's waiting agent), its own business but for `kept.close()`, which a caller that will not look again calls."""

    exit_code = 75  # EX_TEMPFAIL (sysexits.h): the one value of orchestrator.core.leases.EXIT_BUSY

    def __init__(self, busy: list[dict], text: str, kept: Any = None):
        self.busy = list(busy)
        self.kept = kept
        super().__init__(text or "a host the job needs is leased")


class PreflightError(ConfigError):
    """A host or cluster is not usable (unreachable, bad key, no python...). Exit 2, nothing started.
    `bad_hosts` {host: why}: the problems that a spare host could fix (the host cannot run the job; not a setting
    that is wrong everywhere): the api replaces those hosts when the cluster has spares (docs/CONTRACT.md "Bad
    nodes")."""

    def __init__(self, problems: list[Problem] | Problem | str, source: str | None = None,
                 bad_hosts: dict[str, str] | None = None):
        super().__init__(problems, source=source)
        self.bad_hosts = dict(bad_hosts or {})

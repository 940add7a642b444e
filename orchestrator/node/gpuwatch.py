"""GPU health during the job: the node agent's GPU watch (docs/gpus.md "GPU health during the job").

Every `health.gpu_watch_s` seconds (0: off) the agent of a GPU node asks its GPUs' health
(orchestrator.node.gpus.health: nvidia-smi's ECC / retired page / row remap / throttle fields, XIDs from the kernel
log) and judges what changed since its first look by the one rule set (orchestrator.core.gpuhealth.watch):
uncorrectable ECC errors that rose, a pending retirement or remap, a remap failure, a hardware XID stamped after the
job started on this node. A fatal finding names host and GPU (`XID 79 (GPU has fallen off the bus) on GPU 1 of
gpu02`) and, under `health.gpu_check` fail or exclude_host, ends the attempt: the agent stops its launch, says
`GpuHealthError: ...` and records it in its exit record (ExitRecord.gpu_fault), which the supervisor takes as a
failed health check of that host (a spare takes its place, supervise.RestartPolicy). Under warn it is said and the
job runs on. Said once each, never skipped in silence: a kernel log that cannot be read (XIDs not checked),
nvidia-smi failing mid-job, a hardware throttle reason.
Kept in nodes/<R>/gpu_watch.json (GpuWatchRecord, written by the agent only).

Standard library only (runs on every node).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from orchestrator.node.rundir import GpuWatchRecord, RunDir

EXIT_CODE = 74  # EX_IOERR: the node's hardware failed under the job


def _stderr(line: str) -> None:
    os.write(2, (line + "\n").encode())


class GpuWatch:
    """One node's GPU watch: `poll()` each health.gpu_watch_s; returns the fault that ends the attempt, or None."""

    def __init__(self, rd: RunDir, rank: int, host: str, used: tuple[int, ...] | None, every_s: float,
                 policy: str = "fail", health: Callable[[], dict[str, Any]] | None = None,
                 say: Callable[[str], None] | None = None):
        self.rd, self.rank, self.host, self.used, self.policy = rd, rank, host, used, policy
        self.since = time.monotonic()  # the job's start on this node, on the clock the kernel stamps its log with
        self.first: dict[str, Any] | None = None
        self.untimed = 0  # XID lines without a stamp in the first look (only those beyond them are new)
        self.said: set[str] = set()
        self.record = GpuWatchRecord(host=host, every_s=every_s, since=self.since, used=list(used) if used else None)
        if health is None:
            from orchestrator.node.gpus import health as read
            health = lambda: read(apps=False)  # noqa: E731 - (the processes on the GPUs are the job's own)
        self.health = health
        self.say = say or _stderr

    def _once(self, text: str, key: str = "") -> None:
        """Say `text` (a warning) once per `key` (default: the text itself) and keep it in the record."""
        if (key or text) not in self.said:
            self.said.add(key or text)
            self.say(f"orchestrate node agent: warning: GPU watch: {text}")
            self.record = self.record.with_(warnings=self.record.warnings + [text])

    def poll(self) -> str | None:
        from orchestrator.core.gpuhealth import kernel_log_note, throttle, watch
        now = self.health()
        fault = None
        if now.get("missing"):
            self._once(f"{self.host}: nvidia-smi not found: the GPUs are not watched")
        elif now.get("error") and not now.get("gpus"):
            self._once(f"{self.host}: the GPUs' health cannot be read ({str(now['error'])[:200]})", "nvidia-smi")
        elif self.first is None:
            self.first = now
            self.untimed = sum(1 for e in now.get("xid") or [] if not isinstance(e.get("t"), (int, float)))
        if now.get("gpus"):
            note = kernel_log_note(self.host, now)
            if note:
                self._once(note, "kernel log")
            for f in throttle(self.host, now, self.used):
                self._once(f"{f.why} on GPU {f.gpu} of {self.host} ({f.field} = {f.value})",
                           f"throttle {f.gpu} {f.why}")
            found = watch(self.host, self.first or now, now, self.since, self.used, self.untimed)
            if found:
                texts = [f.named() for f in found]
                self.record = self.record.with_(findings=sorted(set(self.record.findings) | set(texts)))
                if self.policy == "warn":
                    for t in texts:
                        self._once(t + " (health.gpu_check: warn)")
                else:
                    fault = "; ".join(texts)
        self.record = self.record.with_(polls=self.record.polls + 1, t=time.time(), fault=fault)
        try:
            self.rd.write_gpu_watch(self.rank, self.record)
        except OSError:
            pass  # (a full disk: what matters is said on stderr and in the exit record)
        return fault

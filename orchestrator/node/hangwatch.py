"""Hang detection inside a SLURM allocation (`Agent.monitor`, `--monitor`): what each node agent's monitor reads per
poll, and how it judges. Standard library + the pure core only.

Cost (issue #29, 1,024 nodes x 8 ranks on one shared filesystem): a poll reads THIS node's ranks' heartbeat files
only (their new lines, by offset; no listing of the shared directory), so each node does O(its own ranks) per poll
whatever the job's size, O(ranks) in all, not O(nodes x ranks) as when every agent read every rank's file.

Judgment: a hang of the job is seen by every node through its own ranks. A rank that is stopped or stuck stops
beating; its peers block in their next collective and stop beating too, so every node's own ranks fall silent
within a step of each other, and each node finds the stall from its own files alone (a node whose ranks are
all fine is not hung, and has nothing to say). Then:
- a node that holds a stopped rank (process state T) names it at once ("process P is stopped");
- a node whose silent ranks all run leaves DEFER_HANG_S + 2 polls for the node that holds the culprit to do so (that
  verdict ends the job: srun --kill-on-bad-exit); if the job is still there after that, it names the culprit itself
  from ONE bounded read of every rank's latest records (heartbeat.read_tails: at most 4 MiB in all, ~512 bytes a
  rank at 8,192 ranks), the longest-silent rank of the job by the ranks' own clocks, as a job-wide view would. That
  read happens once, at the verdict, never per poll.
"""

from __future__ import annotations

from orchestrator.core.health import HealthMonitor, Stall
from orchestrator.core.jobplan import LaunchPlan
from orchestrator.node.heartbeat import HeartbeatTail, read_tails
from orchestrator.node.rundir import RunDir

DEFER_HANG_S = 3.0  # how long a node whose silent ranks all run waits for the culprit's node to name it


class HangWatch:
    """One node's hang judge: `poll(now)` each health.poll_interval, then `verdict(...)` when it returned stalls."""

    def __init__(self, rd: RunDir, plan: LaunchPlan, node_rank: int, started: float):
        self.rd, self.plan, self.started = rd, plan, started
        self.own = tuple(plan.node(node_rank).ranks)
        self.mon = HealthMonitor(plan.health, plan.world_size, started=started, ranks=self.own)
        # this attempt's records only: the files' current ends (a restarted job's health starts from its own records)
        self.tail = HeartbeatTail(rd.heartbeats, set(self.own), from_end=True)
        self.first_seen: float | None = None

    def poll(self, now: float) -> list[Stall]:
        """Read this node's ranks' new heartbeats; their stalls (longest silent first), [] when none is silent."""
        for rec in self.tail.read():
            self.mon.feed(rec, now)
        return self.mon.stalls(now)

    def verdict(self, stalls: list[Stall], stopped: dict[int, int], now: float, every: float) -> str | None:
        """The hang's root-cause text to act on now, or None to wait (see the module's docstring). `stopped`: this
        node's ranks found stopped (rank -> pid)."""
        if stopped:
            return self.mon.culprit(stalls, stopped, now)
        self.first_seen = self.first_seen or now
        if now - self.first_seen < DEFER_HANG_S + 2 * every:
            return None
        job = self.job_monitor()
        job_stalls = job.stalls(now)
        return job.culprit(job_stalls, {}, now) if job_stalls else self.mon.culprit(stalls, {}, now)

    def job_monitor(self) -> HealthMonitor:
        """Every rank of the job as its latest records show it (one bounded read), each record taken as received at
        its own time "t"; records older than this attempt's start are not this attempt's."""
        job = HealthMonitor(self.plan.health, self.plan.world_size, started=self.started)
        for rec in read_tails(self.rd.heartbeats):
            t = rec.get("t")
            if isinstance(t, (int, float)) and t >= self.started:
                job.feed(rec, float(t))
        return job

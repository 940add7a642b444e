"""Rank health from heartbeats: who is alive, who is hung, and whether a run made progress.

Pure: `HealthMonitor` is fed heartbeat records with the time they were received and asked about `now`.
A rank is hung when no heartbeat arrived for `stall_timeout` seconds after its first step,
`startup_timeout` before it (model load), `save_timeout` while it saves a checkpoint. Reading the records
(files, forwarded lines) is orchestrator.node.heartbeat's job. The same monitor judges stragglers: ranks alive
and stepping whose own compute per step ("compute_s" in their step records) is slower than the others' by
health.straggler.factor over health.straggler.window steps (`stragglers`), and ranks that enter the collectives
last by the same factor over the same window of collectives ("arrive" on their step records, from their flight
recorders: `LateArrival`, by their mean lag, and `HoldsUp`, by the share of the time the others wait for them alone).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from heapq import nlargest
from typing import Annotated, Any, Iterable

STRAGGLER_ACTIONS = ("warn", "restart_without")
MAX_WINDOW = 1000  # the most steps of evidence kept per rank (health.straggler.window is capped by it)
MAX_LOSSES = 256  # loss points kept per rank for the curve (`loss_curve`: these and the latest)
ARRIVALS_PENDING = 4096  # collectives whose arrival times wait for their last rank (HealthMonitor._arrive)
# an arrival lag under this is never named: the ranks' wall clocks (NTP across hosts) agree to about a millisecond
ARRIVAL_GAP_S = 0.01
# a rank that holds the others up (enters a collective ARRIVAL_GAP_S or more after all of them) is named only when that
# waiting is at least this share of the job's time more than the other ranks' (`HoldsUp`)
HOLD_SHARE = 0.03
SILENT_LISTED = 16  # a hang's root cause names at most this many other silent ranks (the longest silent)


@dataclass(frozen=True)
class StragglerSpec:
    """A rank that computes slowly while alive. Evidence: the seconds each rank spends in its model's own forward per
    step ("compute_s" on its step records, timed by the zero-code hooks: no collective inside, see
    orchestrator/node/hooks/orchestrate_hooks.py), not its step time (in synchronous data parallelism every rank steps
    at the slowest one's pace). A rank whose median over its last `window` steps exceeds `factor` times the median
    of the other ranks' medians is a straggler: named in the job log, `status` and `status --json` (action warn), or
    also its host taken out and the job restarted on a spare (restart_without)."""

    factor: Annotated[float, "straggler_factor"] = 1.3
    window: Annotated[int, "pos_int"] = 20
    action: Annotated[str, "straggler_action"] = "warn"
    # ... and slower by at least this many seconds per step: sub-millisecond forwards jitter by tens of percent (kernel
    # timing, time-sliced GPUs) without any rank being worth replacing
    min_gap_s: Annotated[float, "nonneg_number"] = 0.002


@dataclass(frozen=True)
class HealthSpec:
    """Hang detection and restarts. A rank whose step does not advance for `stall_timeout` seconds is hung;
    before its first step `startup_timeout` applies (model load), during a checkpoint save `save_timeout`."""

    stall_timeout: float = 300
    startup_timeout: float = 1800
    save_timeout: float = 1800
    # Restarts from the latest checkpoint after a failure, hang or preemption (SLURM requeues count too). None:
    # 3 on SLURM (preemption is routine there), 0 elsewhere; the plan holds the resolved number.
    max_restarts: int | None = None
    poll_interval: float = 1.0
    stack_dumps: bool = True
    # Seconds for the ranks' network pre-flight (orchestrator.node.preflight: every node reaches every other over the
    # real interface, one all-reduce on the real backend) before the model loads; 0 turns it off.
    preflight_timeout: Annotated[float, "nonneg_number"] = 30.0
    # GPU health in the pre-flight (orchestrator.core.gpuhealth): what a bad GPU does to the job (fail: refuse to
    # start; warn: start and say so; exclude_host: do not use the host, a spare takes its place), and whether to run
    # `dcgmi diag -r 1` too (dcgm; skipped with a note where dcgmi is not installed).
    gpu_check: Annotated[str, "gpu_check"] = "fail"
    gpu_diag: Annotated[str, "gpu_diag"] = "none"
    # XID errors in the kernel log count in the pre-flight when they are this recent (seconds; 0: since boot).
    xid_lookback_s: Annotated[float, "nonneg_number"] = 3600.0
    # GPU health during the job: each node agent polls its GPUs this often (seconds; 0 turns the watch off) and ends the
    # attempt on a new fatal finding (orchestrator.node.gpuwatch; judged by orchestrator.core.gpuhealth.watch).
    gpu_watch_s: Annotated[float, "nonneg_number"] = 30.0
    straggler: StragglerSpec = field(default_factory=StragglerSpec)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "HealthSpec":
        """From the plain data a plan holds (plan.json): the straggler block restored, unknown keys ignored."""
        d = {k: v for k, v in (data or {}).items() if k in cls.__dataclass_fields__}
        if isinstance(d.get("straggler"), dict):
            d["straggler"] = StragglerSpec(**{k: v for k, v in d["straggler"].items()
                                              if k in StragglerSpec.__dataclass_fields__})
        return cls(**d)


@dataclass
class RankState:
    rank: int
    host: str = ""
    step: int = 0
    max_steps: int | None = None
    loss: float | None = None
    tokens: int | None = None
    event: str = ""
    t: float = 0.0  # the rank's own clock, for display
    received: float = 0.0  # the monitor's clock
    stepped: bool = False
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss), every `loss_stride`-th one
    loss_stride: int = 1  # doubles each time `losses` is halved: at most MAX_LOSSES points, evenly over the run
    losses_seen: int = 0
    loss_step: int = 0  # the step of `loss`
    compute: deque = field(default_factory=lambda: deque(maxlen=MAX_WINDOW))  # (step, compute_s) of recent steps
    lags: deque = field(default_factory=lambda: deque(maxlen=MAX_WINDOW))  # (collective, s after the first rank)

    def loss_curve(self) -> list[tuple[int, float]]:
        """(step, loss) over the whole run: the kept points and the latest loss."""
        latest = [(self.loss_step, self.loss)] if self.loss is not None else []
        return self.losses + latest if self.losses and latest and self.losses[-1] != latest[0] else \
            self.losses or latest


@dataclass(frozen=True)
class Straggler:
    """A rank judged slow, with the evidence: its median forward seconds per step over `window` steps against the
    median of the other ranks'."""

    rank: int
    host: str
    median_s: float
    others_s: float
    window: int
    step: int

    @property
    def ratio(self) -> float:
        return self.median_s / self.others_s if self.others_s > 0 else float("inf")

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host or '?'} is a straggler: {self.median_s * 1000:.1f} ms of its own "
                f"forward per step against {self.others_s * 1000:.1f} ms for the other ranks ({self.ratio:.2f}x, "
                f"median of the last {self.window} steps, at step {self.step})")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "median_s": round(self.median_s, 6),
                "others_s": round(self.others_s, 6), "ratio": round(self.ratio, 3), "window": self.window,
                "step": self.step}


@dataclass(frozen=True)
class LateArrival(Straggler):
    """A rank judged slow by when it enters the collectives (its flight recorder, "arrive" on its step records):
    its lateness (`lateness`: the mean lag behind the first rank to enter, the largest tenth left out) over the last
    `window` collectives that every rank entered, against the median of the other ranks' lateness. It names a rank
    that is slow anywhere in its step (data loading, CPU work outside the model, a host whose CPU is taken), which
    its forward time does not show."""

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host or '?'} is a straggler: it enters the collectives "
                f"{self.median_s * 1000:.1f} ms after the first rank, the other ranks {self.others_s * 1000:.1f} ms "
                f"(mean of the last {self.window} collectives, at step {self.step})")

    def to_dict(self) -> dict[str, Any]:
        return dict(super().to_dict(), evidence="arrival", ratio=round(min(self.ratio, 999.0), 3))


@dataclass(frozen=True)
class HoldsUp(LateArrival):
    """A rank judged slow by the share of the job's time that the other ranks spend waiting for it alone (`share`,
    in `median_s`: the sum of its margins over the second-last rank to enter, on the collectives it entered
    ARRIVAL_GAP_S or more after every other rank, its largest tenth left out, over the time those collectives span),
    against the median of the other ranks' shares. It names a rank stopped or slowed in short bursts (a host whose
    CPU is taken half the time) whose lateness falls on few collectives, which its mean lag dilutes."""

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host or '?'} is a straggler: the other ranks wait for it alone "
                f"{self.median_s * 100:.1f} % of the time, for the others {self.others_s * 100:.1f} % (it enters "
                f"collectives {ARRIVAL_GAP_S * 1000:.0f} ms or more after every other rank; the last {self.window} "
                f"collectives, at step {self.step})")

    def to_dict(self) -> dict[str, Any]:
        return dict(super().to_dict(), measure="wait_share")


@dataclass(frozen=True)
class Stall:
    rank: int
    host: str
    step: int
    silent_s: float
    limit_s: float
    phase: str  # startup | training | saving

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host or '?'} hung: no heartbeat for {self.silent_s:.0f}s during "
                f"{self.phase} (limit {self.limit_s:.0f}s), last step {self.step}")


def median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` with one occurrence of `value` taken out, in O(log n) (a monitor of 8,192 ranks
    asks it of every rank); `value` itself when it is the only one."""
    n = len(ordered)
    if n < 2:
        return value
    i = bisect_left(ordered, value)

    def at(k: int) -> float:  # the k-th of the n - 1 values left
        return ordered[k if k < i else k + 1]
    m = n - 1
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def lateness(lags: Iterable[tuple[int, float]]) -> float:
    """A rank's lateness from its (collective, lag) samples: the mean lag with the largest tenth left out. Not the
    median: a rank slow once a step is late at one collective of the step and on time at the others (a DDP step's
    gradient all-reduce, then a loss all-reduce), so its median lag is an on-time one; the largest tenth is left out
    so that one long pause (a garbage collection) does not name a rank."""
    vals = sorted(c for _, c in lags)
    keep = vals[:len(vals) - len(vals) // 10] or vals
    return sum(keep) / len(keep) if keep else 0.0


class HealthMonitor:
    def __init__(self, health: HealthSpec, world_size: int, started: float, ranks: Iterable[int] | None = None):
        """`ranks`: the ranks whose stalls it judges (default all of `world_size`; a node agent's monitor inside a
        SLURM allocation: its own, orchestrator.node.hangwatch)."""
        self.judged = sorted(ranks) if ranks is not None else range(world_size)
        self.stall_timeout = float(health.stall_timeout)
        self.startup_timeout = float(health.startup_timeout)
        self.save_timeout = float(health.save_timeout)
        self.world_size = world_size
        self.started = started
        self.ranks: dict[int, RankState] = {}
        strag = getattr(health, "straggler", None) or StragglerSpec()
        self.straggler_factor = float(strag.factor)
        self.straggler_window = min(int(strag.window), MAX_WINDOW)
        self.straggler_gap = float(strag.min_gap_s)
        self.arrivals: dict[int, dict[int, float]] = {}  # collective number -> rank -> when it entered it
        # the collectives every rank entered: (number, when the first rank entered it, the last rank, its margin over
        # the second-last): the evidence of `hold_shares`
        self.joined: deque[tuple[int, float, int, float]] = deque(maxlen=MAX_WINDOW)

    def feed(self, rec: dict[str, Any], received: float) -> None:
        try:
            rank = int(rec["rank"])
        except (KeyError, TypeError, ValueError):
            return
        st = self.ranks.get(rank)
        if st is None:
            st = self.ranks[rank] = RankState(rank, compute=deque(maxlen=self.straggler_window))
        st.received = received
        st.t = float(rec.get("t") or 0.0)
        st.host = str(rec.get("host") or st.host)
        st.event = str(rec.get("event") or "")
        step = rec.get("step")
        if isinstance(step, int):
            st.step = max(st.step, step)
        if rec.get("max_steps") is not None:
            st.max_steps = rec.get("max_steps")
        if rec.get("tokens") is not None:
            st.tokens = rec.get("tokens")
        loss = rec.get("loss")
        if isinstance(loss, (int, float)):
            st.loss, st.loss_step = float(loss), st.step
            if st.losses_seen % st.loss_stride == 0:
                st.losses.append((st.step, float(loss)))
                if len(st.losses) > MAX_LOSSES:  # bounded, the whole run's shape kept: every other point
                    st.losses, st.loss_stride = st.losses[::2], st.loss_stride * 2
            st.losses_seen += 1
        if st.event == "boot":  # a (re)started rank: start-up again, whatever an earlier attempt reached
            st.stepped = False
            st.compute.clear()
            st.lags.clear()
            self.arrivals.clear()  # (a new process group numbers its collectives from 1 again)
            self.joined.clear()
        arrive = rec.get("arrive")
        if isinstance(arrive, list):
            self._arrive(rank, arrive)
        compute = rec.get("compute_s")
        if isinstance(compute, (int, float)) and compute > 0 and isinstance(step, int):
            st.compute.append((step, float(compute)))
        if st.event in ("step", "save_start", "save") and isinstance(step, int) and step > 0:
            st.stepped = True

    def _arrive(self, rank: int, pairs: list) -> None:
        """Join the ranks' arrival times per collective; once every rank entered one, each rank's lag behind the
        first to enter it is evidence (bounded: at most ARRIVALS_PENDING collectives wait for their last rank)."""
        for pair in pairs:
            try:
                seq, t = int(pair[0]), float(pair[1])
            except (TypeError, ValueError, IndexError):
                continue
            got = self.arrivals.setdefault(seq, {})
            got[rank] = t
            if len(got) == self.world_size:
                first = min(got.values())
                for r, tr in got.items():
                    st = self.ranks.get(r)
                    if st is not None:
                        st.lags.append((seq, tr - first))
                if len(got) > 1:
                    t_last, t_next = nlargest(2, got.values())  # (C-speed passes: 0.6 ms at 8,192 ranks)
                    self.joined.append((seq, first, max(got, key=got.__getitem__), t_last - t_next))
                del self.arrivals[seq]
        if len(self.arrivals) > ARRIVALS_PENDING:
            for seq in sorted(self.arrivals)[:len(self.arrivals) - ARRIVALS_PENDING]:
                del self.arrivals[seq]

    def hold_shares(self) -> dict[int, float]:
        """Each rank's share of the time the others wait for it alone, over the last MAX_WINDOW (or fewer) collectives
        every rank entered: the sum of its margins over the second-last rank to enter, on the collectives it entered
        ARRIVAL_GAP_S or more after every other rank (hosts' clocks agree to about a millisecond), with its largest
        tenth of them (at least one) left out so that one pause never names a rank, over the time from each of those
        collectives' predecessor to it, summed (the recorder is read every 2 s: a fast loop's collectives may be
        sampled, not all seen)."""
        rows = sorted(self.joined)
        span = 0.0
        held: dict[int, list[float]] = {r: [] for r in self.ranks}
        for (seq0, t0, _, _), (seq, t, last, margin) in zip(rows, rows[1:], strict=False):
            if seq == seq0 + 1:
                span += t - t0
                if margin >= ARRIVAL_GAP_S:
                    held.setdefault(last, []).append(margin)
        out = {}
        for r, margins in held.items():
            margins.sort()
            out[r] = sum(margins[:len(margins) - max(1, len(margins) // 10)]) / span if span > 0 else 0.0
        return out

    def stalls(self, now: float) -> list[Stall]:
        """Hung ranks, the longest silent first. Ranks that ended are never hung."""
        out = []
        for rank in self.judged:
            st = self.ranks.get(rank)
            if st is not None and st.event in ("end", "preempted"):
                continue
            if st is None or not st.stepped:
                ref, limit, phase = (st.received if st else self.started), self.startup_timeout, "startup"
            elif st.event == "save_start":
                ref, limit, phase = st.received, self.save_timeout, "checkpoint save"
            else:
                ref, limit, phase = st.received, self.stall_timeout, "training"
            silent = now - ref
            if silent > limit:
                out.append(Stall(rank, st.host if st else "", st.step if st else 0, silent, limit, phase))
        return sorted(out, key=lambda s: (-s.silent_s, s.rank))

    def silence(self, rank: int, now: float) -> Stall:
        """How long `rank` has been silent, whether or not that crossed its limit yet."""
        st = self.ranks.get(rank) or RankState(rank, received=self.started)
        limit, phase = ((self.startup_timeout, "startup") if not st.stepped else
                        (self.save_timeout, "checkpoint save") if st.event == "save_start" else
                        (self.stall_timeout, "training"))
        return Stall(rank, st.host, st.step, now - st.received, limit, phase)

    def culprit(self, stalls: list[Stall], stopped: dict[int, int], now: float) -> str:
        """Root-cause text of a hang: a rank found stopped wins (even if its own silence is still under the limit,
        as when its last heartbeats arrived a moment after its peers'), else the longest-silent rank."""
        first = next((x for x in stalls if x.rank in stopped), None)
        if first is None and stopped:
            first = self.silence(min(stopped), now)
        first = first or stalls[0]
        text = first.describe() + (f" (process {stopped[first.rank]} is stopped)" if first.rank in stopped else "")
        others = [str(x.rank) for x in stalls if x.rank != first.rank]
        if len(others) > SILENT_LISTED:  # (a job of thousands of ranks: every one of them is silent in a hang)
            others = others[:SILENT_LISTED] + [f"{len(others) - SILENT_LISTED:,} more"]
        return text + (f"; ranks {', '.join(others)} also silent" if others else "")

    def stragglers(self) -> list[Straggler]:
        """Ranks slower than the others by health.straggler.factor (and by at least min_gap_s) over the last
        health.straggler.window steps, the slowest first. Judged only once every rank has a full window of evidence
        (nothing is said on less), against the median of the OTHER ranks' medians (with 2 ranks: the other one)."""
        from statistics import median  # (imported here: the node agent and the CLI's start need HealthSpec only)
        n = self.straggler_window
        out: list[Straggler] = []
        shares = self.hold_shares() if len(self.joined) >= n else {}
        # per kind of evidence: its floor, and each rank's measure (None: not enough evidence yet, nobody is judged)
        kinds = ((Straggler, self.straggler_gap,
                  lambda r, st: median(c for _, c in st.compute) if len(st.compute) >= n else None),
                 (LateArrival, max(self.straggler_gap, ARRIVAL_GAP_S),
                  lambda r, st: lateness(st.lags) if len(st.lags) >= n else None),
                 (HoldsUp, HOLD_SHARE, lambda r, st: shares.get(r) if len(st.lags) >= n else None))
        for kind, gap, measure in kinds:
            found = {r: measure(r, st) if (st := self.ranks.get(r)) is not None else None
                     for r in range(self.world_size)}
            medians: dict[int, float] = {r: m for r, m in found.items() if m is not None}
            if len(medians) < len(found):
                continue
            ordered = sorted(medians.values())
            for r, m in medians.items():
                others = median_without(ordered, m)
                slower = m > self.straggler_factor * others and m - others >= gap
                if slower and (others > 0 or kind is not Straggler) and all(x.rank != r for x in out):
                    st = self.ranks[r]
                    out.append(kind(r, st.host, m, others, len(self.joined) if kind is HoldsUp else n, st.step))
        return sorted(out, key=lambda x: -x.ratio)

    def evidence(self) -> dict[int, float]:
        """Each rank's median forward seconds per step over its last window (or fewer) steps: status's column."""
        from statistics import median
        return {r: median(c for _, c in st.compute) for r, st in sorted(self.ranks.items()) if st.compute}

    def arrival_evidence(self) -> dict[int, float]:
        """Each rank's lateness into the collectives (`lateness`), over its last window (or fewer)."""
        return {r: lateness(st.lags) for r, st in sorted(self.ranks.items()) if st.lags}

    def progress(self) -> int:
        """The step every rank has reached (the slowest rank's step)."""
        if not self.ranks:
            return 0
        return min((self.ranks[r].step if r in self.ranks else 0) for r in range(self.world_size))

    def snapshot(self) -> list[RankState]:
        return [self.ranks[r] for r in sorted(self.ranks)]

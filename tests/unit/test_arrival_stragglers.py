"""Stragglers named by arrival (issue #34 item 7), the pure part: each rank's step records carry when it entered the
default group's collectives ("arrive", from its flight recorder); the HealthMonitor joins them per collective and
names a rank that enters them last by health.straggler.factor over health.straggler.window collectives, with the
same rules as the forward-time evidence, and no one on an even run."""

from __future__ import annotations

import random

from orchestrator.core.health import ARRIVALS_PENDING, HealthMonitor, HealthSpec, LateArrival, StragglerSpec


def run(world: int, late: dict[int, float], collectives: int = 40, jitter: float = 0.002, seed: int = 0,
        **straggler) -> HealthMonitor:
    mon = HealthMonitor(HealthSpec(straggler=StragglerSpec(**straggler)), world, started=0.0)
    rnd = random.Random(seed)
    for step in range(1, collectives // 2 + 1):  # two collectives a step, sent with the step record
        for r in range(world):
            pairs = [[2 * step - 1 + k, 100.0 + step + rnd.random() * jitter + late.get(r, 0.0) * rnd.random() * 2]
                     for k in range(2)]
            mon.feed({"rank": r, "host": f"h{r}", "step": step, "event": "step", "arrive": pairs}, 0.0)
    return mon


def test_a_rank_that_enters_the_collectives_last_is_named():
    mon = run(4, {1: 0.05}, window=20)
    [s] = mon.stragglers()
    assert isinstance(s, LateArrival) and s.rank == 1 and s.window == 20
    assert s.describe().startswith("rank 1 on h1 is a straggler: it enters the collectives ")
    assert s.to_dict()["evidence"] == "arrival"
    assert set(mon.arrival_evidence()) == {0, 1, 2, 3}


def test_an_even_run_names_no_one():
    for seed in range(5):
        assert run(4, {}, seed=seed, window=20).stragglers() == []
        assert run(8, {}, jitter=0.008, seed=seed, window=20).stragglers() == []  # clock-level jitter: under 10 ms


def test_nothing_is_said_before_a_full_window_and_pending_stays_bounded():
    assert run(4, {1: 0.05}, collectives=10, window=20).stragglers() == []
    mon = HealthMonitor(HealthSpec(), 4, started=0.0)
    mon.feed({"rank": 0, "step": 1, "event": "step", "arrive": [[i, 1.0] for i in range(ARRIVALS_PENDING + 50)]}, 0.0)
    assert len(mon.arrivals) == ARRIVALS_PENDING


def test_a_restart_starts_the_evidence_again():
    mon = run(2, {1: 0.05}, window=10)
    assert mon.stragglers()
    for r in range(2):
        mon.feed({"rank": r, "event": "boot"}, 0.0)
    assert mon.stragglers() == [] and not mon.arrivals

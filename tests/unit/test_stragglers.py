"""Stragglers, the pure parts (issue #26 item 2): the HealthMonitor judges each rank's own forward time per step
("compute_s" in its step records) against the other ranks' over health.straggler.window steps; the supervisor's
StragglerLog names each straggler once and keeps RUN_DIR/stragglers.json; judge() makes a restart_without verdict a
failure attributable to the straggler's host, which the one RestartPolicy takes out at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.core.health import HealthMonitor, HealthSpec, StragglerSpec
from orchestrator.core.spec import load
from orchestrator.errors import ConfigError
from orchestrator.events import NodeEnded
from orchestrator.supervise import RestartPolicy, StragglerLog, judge


REPO = Path(__file__).resolve().parents[2]


def feed(mon: HealthMonitor, rank: int, steps: range, compute: float, host: str = "") -> None:
    for s in steps:
        mon.feed({"rank": rank, "host": host or f"h{rank}", "step": s, "event": "step", "compute_s": compute}, 0.0)


def monitor(world: int, **straggler) -> HealthMonitor:
    return HealthMonitor(HealthSpec(straggler=StragglerSpec(**straggler)), world, started=0.0)


def test_a_rank_slower_than_the_others_by_the_factor_is_named_with_its_evidence():
    mon = monitor(4, factor=1.3, window=10)
    for r in range(3):
        feed(mon, r, range(1, 11), 0.100)
    feed(mon, 3, range(1, 11), 0.150)
    [s] = mon.stragglers()
    assert (s.rank, s.host, s.window, s.step) == (3, "h3", 10, 10)
    assert s.ratio == pytest.approx(1.5)
    assert s.describe() == ("rank 3 on h3 is a straggler: 150.0 ms of its own forward per step against 100.0 ms for "
                            "the other ranks (1.50x, median of the last 10 steps, at step 10)")
    assert mon.evidence() == {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.15}


def test_nothing_is_said_before_every_rank_has_a_full_window_nor_under_the_factor():
    mon = monitor(2, factor=1.3, window=10)
    feed(mon, 0, range(1, 11), 0.1)
    feed(mon, 1, range(1, 10), 0.5)  # 9 steps of evidence: not yet
    assert mon.stragglers() == []
    feed(mon, 1, range(10, 11), 0.5)
    assert [s.rank for s in mon.stragglers()] == [1]
    even = monitor(2, factor=1.3, window=10)
    feed(even, 0, range(1, 11), 0.100)
    feed(even, 1, range(1, 11), 0.125)  # 1.25x: within the factor
    assert even.stragglers() == []


def test_the_median_of_the_window_ignores_a_few_slow_steps_and_a_restart_forgets_the_old_evidence():
    mon = monitor(2, factor=1.3, window=10)
    feed(mon, 0, range(1, 11), 0.1)
    feed(mon, 1, range(1, 7), 0.1)
    feed(mon, 1, range(7, 11), 0.9)  # 4 slow steps of 10 (an evaluation, a checkpoint): not a straggler
    assert mon.stragglers() == []
    feed(mon, 1, range(11, 20), 0.9)
    assert [s.rank for s in mon.stragglers()] == [1]
    mon.feed({"rank": 1, "step": 0, "event": "boot"}, 0.0)  # a new attempt of the rank
    assert mon.stragglers() == [] and 1 not in mon.evidence()


def test_a_sub_millisecond_difference_is_no_straggler_whatever_the_ratio():
    mon = monitor(2, factor=1.3, window=5)  # (min_gap_s 0.002 by default)
    feed(mon, 0, range(1, 6), 0.0009)
    feed(mon, 1, range(1, 6), 0.0014)  # 1.56x, 0.5 ms: jitter of a time-sliced GPU, seen on an H200
    assert mon.stragglers() == []
    mon = monitor(2, factor=1.3, window=5, min_gap_s=0.0)
    feed(mon, 0, range(1, 6), 0.0009)
    feed(mon, 1, range(1, 6), 0.0014)
    assert [s.rank for s in mon.stragglers()] == [1]


def test_with_two_ranks_the_slow_one_is_named_not_both():
    mon = monitor(2, factor=1.3, window=5)
    feed(mon, 0, range(1, 6), 0.1)
    feed(mon, 1, range(1, 6), 0.2)
    assert [s.rank for s in mon.stragglers()] == [1]


def test_the_log_names_each_straggler_once_and_keeps_the_record(tmp_path):
    from types import SimpleNamespace
    plan = SimpleNamespace(run_dir=str(tmp_path), health=HealthSpec(straggler=StragglerSpec(window=5)))
    log = StragglerLog(plan, attempt=2)
    mon = monitor(2, window=5)
    feed(mon, 0, range(1, 6), 0.1)
    feed(mon, 1, range(1, 6), 0.3)
    assert [s.rank for s in log.judge(mon, 100.0)] == [1]
    feed(mon, 1, range(6, 20), 0.3)
    assert log.judge(mon, 200.0) == []  # named once
    data = json.loads((tmp_path / "stragglers.json").read_text())
    assert [(n["rank"], n["host"], n["attempt"], n["action"], n["ratio"]) for n in data["named"]] == [
        (1, "h1", 2, "warn", 3.0)]
    assert data["evidence"] == {"0": 0.1, "1": 0.3} and data["window"] == 5


def test_a_restart_without_verdict_is_a_failure_of_the_stragglers_host_which_goes_at_once():
    ends = {0: NodeEnded(0, "a", 143, "", None), 1: NodeEnded(1, "b", 143, "", None)}
    r = judge(ends, torn_down_at=1.0, hang=None, cancel=None, straggler="rank 1 on b is a straggler: ...",
              straggler_host="b")
    assert (r.state, r.culprit_host, r.culprit_kind) == ("FAILED", "b", "straggler")
    d = RestartPolicy(3).decide([], step=10, counted=0, culprit_host="b", culprit_kind="straggler", spares=1)
    assert d.restart and d.exclude == "b"


@pytest.mark.parametrize("override, message", [
    ("health.straggler.factor=1", "health.straggler.factor: must be a number > 1, got 1"),
    ("health.straggler.window=0", "health.straggler.window: must be an integer >= 1, got 0"),
    ("health.straggler.action=restart", "health.straggler.action: must be one of warn, restart_without, got "
                                        "'restart'"),
    ("health.straggler.windw=5", "health.straggler.windw: unknown key"),
])
def test_bad_straggler_settings_are_named(override, message):
    with pytest.raises(ConfigError) as e:
        load(str(REPO / "recipes/configs/sft_tiny.yaml"), None, overrides=[override])
    assert message in str(e.value), str(e.value)


def test_the_median_of_the_others_is_the_median_without_the_rank():
    import random
    from statistics import median

    from orchestrator.core.health import median_without
    rng = random.Random(7)
    for n in range(1, 30):
        values = [rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(n)]
        ordered = sorted(values)
        for i, v in enumerate(values):
            rest = values[:i] + values[i + 1:]
            assert median_without(ordered, v) == (median(rest) if rest else v), (values, i)

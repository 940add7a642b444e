"""Sweeps, the pure parts: the --sweep grid (orchestrator/core/sweep.py) and the early-stop judge (sweep.Curves)."""

from __future__ import annotations

import pytest

from orchestrator.core.sweep import expand, split_values
from orchestrator.errors import ConfigError
from orchestrator.sweep import Curves


def test_the_grid_is_the_product_in_option_order_and_commas_in_brackets_stay():
    pts = expand(["a.lr=1,2", "b.seed=7,8,9"])
    assert [p.overrides for p in pts][:4] == [("a.lr=1", "b.seed=7"), ("a.lr=1", "b.seed=8"), ("a.lr=1", "b.seed=9"),
                                              ("a.lr=2", "b.seed=7")] and len(pts) == 6
    assert split_values("{a: 1, b: 2},[3, 4],'x,y'") == ["{a: 1, b: 2}", "[3, 4]", "'x,y'"]
    for bad in (["a.lr"], ["a.lr=1,,2"], ["a.lr=1", "a.lr=2"], ["a.lr=1,1"], ["9x=1"]):
        with pytest.raises(ConfigError):
            expand(bad)


def test_a_point_is_judged_at_the_latest_step_it_shares_and_nan_stops_it_at_once(tmp_path):
    c = Curves()
    doc = {"points": []}
    c.loss = {0: {1: 6.0, 2: 5.0}, 1: {1: 6.0, 2: 9.0, 3: 12.0, 4: 20.0}}  # p1 runs ahead of p0
    assert list(c.judge(doc, {1}, 1.5)) == [1]  # judged at step 2 (9.0 > 1.5 x 5.0), not left running ahead
    c.loss = {0: {1: 6.0, 2: 5.0}, 1: {1: 6.0, 2: 7.0, 3: 99.0}}
    assert c.judge(doc, {1}, 1.5) == {}  # 7.0 at the shared step 2 is within 1.5 x 5.0
    c.loss = {0: {}, 1: {1: float("nan")}}
    assert "nan at step 1" in c.judge(doc, {1}, 1.5)[1]

"""Sweeps, the pure parts: the --sweep grid (orchestrator/core/sweep.py) and the early-stop judge (sweep.Curves)."""

from __future__ import annotations

import pytest

from orchestrator.core.sweep import expand, split_values
from orchestrator.errors import ConfigError
from orchestrator.sweeps import Curves


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


def test_a_sweep_block_is_the_same_grid_and_the_command_line_replaces_or_adds_keys():
    from omegaconf import OmegaConf

    from orchestrator.core.sweep import block_options, merge_options
    opts = block_options({"trainer.learning_rate": [1e-5, 3e-4], "trainer.lr_scheduler_type": ["cosine", "a,b"],
                          "trainer.lr_scheduler_kwargs": [{"min_lr": 0.1}]})
    pts = expand(opts)
    assert len(pts) == 4 and pts[0].overrides[0] == "trainer.learning_rate=1e-05"
    # every value reads back through the dotlist as written in the file (a string with a comma stays one string)
    back = OmegaConf.to_container(OmegaConf.from_dotlist(list(pts[1].overrides)))
    assert back == {"trainer": {"learning_rate": 1e-5, "lr_scheduler_type": "a,b",
                                "lr_scheduler_kwargs": {"min_lr": 0.1}}}
    merged = merge_options(opts, ["trainer.learning_rate=1e-3", "trainer.seed=1,2"])
    assert [o.partition("=")[0] for o in merged] == ["trainer.learning_rate", "trainer.lr_scheduler_type",
                                                     "trainer.lr_scheduler_kwargs", "trainer.seed"]
    assert merged[0] == "trainer.learning_rate=1e-3"


def test_a_job_file_with_a_sweep_block_plans_every_point_and_bad_blocks_are_named(tmp_path):
    import subprocess
    import sys

    from helpers import OFFLINE_ENV, REPO
    base = (REPO / "recipes/configs/sft_tiny.yaml").read_text()
    env = {"ORCHESTRATE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", **OFFLINE_ENV}

    def submit(block: str, *extra: str):
        job = tmp_path / "job.yaml"
        job.write_text(base + "\n" + block)
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(job), "--nodes", "2",
                               "--dry-run", *extra], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    ok = submit("sweep:\n  grid: {trainer.learning_rate: [1.0e-4, 3.0e-4], trainer.seed: [1, 2]}\n  max_parallel: 2\n",
                "--sweep", "trainer.seed=5")
    assert ok.returncode == 0, ok.stderr
    lines = [ln.split(None, 1)[1] for ln in ok.stdout.splitlines() if ln.startswith("  p")]
    assert lines == ["trainer.learning_rate=0.0001 trainer.seed=5", "trainer.learning_rate=0.0003 trainer.seed=5"]
    for block, key in (("sweep:\n  grid: {}\n", "sweep.grid"), ("sweep:\n  grid: {'9bad': [1]}\n", "sweep.grid.9bad"),
                       ("sweep:\n  grid: {trainer.seed: []}\n", "sweep.grid.trainer.seed"),
                       ("sweep:\n  grid: {trainer.seed: [1]}\n  max_parallel: 0\n", "sweep.max_parallel"),
                       ("sweep:\n  grid: {trainer.seed: [1]}\n  stop_if_worse: 0.5\n", "sweep.stop_if_worse"),
                       ("sweep:\n  grid: {trainer.seed: [1]}\n  paralel: 2\n", "sweep.paralel")):
        bad = submit(block)
        assert bad.returncode == 2 and key in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, \
            (block, bad.stderr)
    bad_point = submit("sweep:\n  grid: {trainer.learning_rate: [1.0e-4, fast]}\n")
    assert bad_point.returncode == 2 and "point p1" in bad_point.stderr and "learning_rate" in bad_point.stderr


def test_the_sweep_grammar_takes_lists_ranges_and_spacings_and_a_bad_one_names_the_grammar():
    from orchestrator.core.sweep import GRAMMAR, block_options
    assert [p.overrides for p in expand(["a.lr=[1e-4,3e-4]"])] == [("a.lr=1e-4",), ("a.lr=3e-4",)]
    assert [p.overrides[0] for p in expand(["a.n=1..4"])] == ["a.n=1", "a.n=2", "a.n=3", "a.n=4"]
    assert [p.overrides[0] for p in expand(["a.n=0..8:4"])] == ["a.n=0", "a.n=4", "a.n=8"]
    assert [p.overrides[0] for p in expand(["a.lr=log:1e-5:1e-3:3"])] == ["a.lr=1e-05", "a.lr=0.0001", "a.lr=0.001"]
    assert [p.overrides[0] for p in expand(["a.w=lin:0:1:3"])] == ["a.w=0", "a.w=0.5", "a.w=1"]
    # a list-valued key: each list whole, or one list as [[...]] (how a job file's single list value is written)
    assert [p.overrides[0] for p in expand(["a.l=[1,2],[3,4]"])] == ["a.l=[1,2]", "a.l=[3,4]"]
    assert [p.overrides[0] for p in expand(block_options({"a.l": [[1, 2]]}))] == ["a.l=[1, 2]"]
    assert len(expand(block_options({"a.lr": "log:1e-5:1e-3:4"}))) == 4
    for bad in ("a.n=4..1", "a.n=1..4:0", "a.lr=log:0:1:3", "a.lr=log:x:1:3", "a.lr=lin:0:1:1", "a.lr=log:1:2",
                "a.n=1..x"):
        with pytest.raises(ConfigError) as e:
            expand([bad])
        assert GRAMMAR in str(e.value) and "trainer" not in str(e.value)

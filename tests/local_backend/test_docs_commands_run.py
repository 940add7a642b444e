"""Docs that run: every command the docs show (a line of a fenced block that starts with `orchestrate`, a cluster
file's comment line that does) runs VERBATIM, in document order, and must exit 0 (or the code its annotation
shows). Real jobs on this machine: the README's own submit, detach and attach, status, logs, plot, cancel, its sweep
and gc. What is extracted, the environment and the annotations: tests/doccommands.py. Commands annotated `skip`
(an example site's cluster) or `slurm` (tests/slurm/test_docs_commands_slurm.py) are reported as skipped here.

A command that fails is a docs bug: fix the doc (or the CLI, where the doc shows what a user would rightly expect)."""

from __future__ import annotations

import re

import pytest
from doccommands import Shown, collect, doc_env, run_shown
from helpers import JobGuard

pytestmark = pytest.mark.slow

SHOWN, _, _, _ = collect()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("docs_run")
    home = base / "home"
    guard = JobGuard()
    guard.home(home)
    try:
        yield run_shown([s for s in SHOWN if s.action == "run" or s.action.startswith("exit ")], doc_env(home), base)
    finally:
        guard.teardown()


@pytest.mark.parametrize("shown", SHOWN, ids=[f"{s.where} {s.text}"[:90] for s in SHOWN])
def test_shown_command_runs_verbatim(shown: Shown, results):
    if shown.action in ("skip", "slurm"):
        pytest.skip(f"{shown.where}: doc-test: {shown.action}: {shown.reason}")
    rc, out, variables, took = results[shown]
    shown_vars = {k: v for k, v in variables.items() if f"${k}" in shown.text}
    unset = [v for v in re.findall(r"\$(\w+)", shown.text) if v not in variables]
    assert not unset, f"{shown.where}: ${unset[0]} is set by no submit shown before it: {shown.text}"
    assert rc == shown.exit_code, (f"{shown.where}: `{shown.text}` exited {rc}, the doc shows "
                                   f"{shown.exit_code} (with {shown_vars}, {took:.1f} s): fix the doc\n{out[-3000:]}")


def test_runner_sees_a_failing_command(tmp_path):
    """The runner runs the line as it is: `render` without `--out` (what docs/gpus.md once showed) exits 2, and
    a variable comes from the submit before it."""
    shown = [Shown("x:1", "orchestrate render recipes/configs/sft_tiny.yaml --nodes 2"),
             Shown("x:2", "orchestrate render recipes/configs/sft_tiny.yaml --nodes 2 --out $DIR ; "
                          "test -s $DIR/plan.json")]
    got = run_shown(shown, doc_env(tmp_path / "home"), tmp_path, timeout=120)
    assert got[shown[0]][0] == 2 and "--out" in got[shown[0]][1]
    assert got[shown[1]][0] == 0, got[shown[1]][1]

"""`orchestrate plot` after a plain install (issue #37): matplotlib comes with orchestrate, and where it cannot be
imported all the same the command says in one line what to install (never a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from view_helpers import status_fixture

REPO = Path(__file__).resolve().parents[2]

PLOT_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # how Python spells "not installed": every import of it raises ImportError
from orchestrator.store import JobStore
JobStore().create(job_id="sft-1", recipe="r.yaml", recipe_digest="d", cluster="c", backend="local", nodes=2,
                  world_size=2, run_dir=sys.argv[1])
from orchestrator.cli.main import main
sys.exit(main(["plot", "sft-1"]))
"""


def test_matplotlib_is_a_dependency():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("matplotlib") for d in deps), deps


def test_plot_without_matplotlib_says_what_to_install_in_one_line(tmp_path):
    rec = status_fixture(tmp_path)
    env = {**os.environ, "ORCHESTRATE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", PLOT_WITHOUT_MATPLOTLIB, rec["run_dir"]], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == ["orchestrate: error: orchestrate plot needs matplotlib, which is not "
                                             "installed here: pip install matplotlib"], r.stderr
    assert not (Path(rec["run_dir"]) / "plot.png").exists()

"""docs/api.md's examples run (issue #36): every ```python block of the page, as a reader would paste it, in a
fresh interpreter, from a directory that has the repository's `recipes/` and `examples/` (so its outputs/ stay
out of the repository), with a temporary ORCHESTRATE_HOME; each must exit 0. The page's table names exactly
`orchestrator.__all__`."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

import orchestrator
from helpers import OFFLINE_ENV, PYTHON

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "api.md"


def blocks() -> list[tuple[int, str]]:
    """(line, code) of every ```python block."""
    text = PAGE.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(r"^```python\n(.*?)^```$", text,
                                                                               re.M | re.S)]


def test_the_table_names_every_public_name():
    table = PAGE.read_text().split("\n## ", 1)[0]
    named = set(re.findall(r"`(?:orchestrator\.)?([A-Za-z]+)[(`.]", table))
    assert set(orchestrator.__all__) - named == set(), set(orchestrator.__all__) - named
    assert len(blocks()) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("line, code", blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_a_documented_example_runs(line, code, tmp_path, job_guard):
    for name in ("recipes", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    home = job_guard.home(tmp_path / "home")
    env = {**os.environ, **OFFLINE_ENV, "ORCHESTRATE_HOME": str(home), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"docs/api.md:{line}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    print(r.stdout)

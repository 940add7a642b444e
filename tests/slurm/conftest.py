"""Fixtures for the SLURM backend tests: the local cluster (scripts/slurm_cluster.sh) for the session.

The cluster needs root and Debian's slurm/munge/mariadb packages: without them the `slurm` tests skip
with the reason, except under CI=true, where they fail instead. A cluster that is already up is reused
and left up; one brought up here is torn down at the end (ORCHESTRATE_SLURM_KEEP=1 keeps it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_helpers import CLUSTER_DIR, NODES, SCRIPT, WORK, unavailable


@pytest.fixture(scope="session")
def slurm_cluster():
    why = unavailable()

    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)
    env = dict(os.environ, ORCHESTRATE_SLURM_DIR=CLUSTER_DIR)
    was_up = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True).returncode == 0
    if not was_up:
        r = subprocess.run([str(SCRIPT), "up", "--nodes", str(NODES)], env=env, capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            pytest.fail(f"slurm_cluster.sh up failed:\n{r.stdout}\n{r.stderr}")
    os.environ["SLURM_CONF"] = f"{CLUSTER_DIR}/etc/slurm.conf"
    WORK.mkdir(parents=True, exist_ok=True)
    yield {"dir": CLUSTER_DIR, "nodes": NODES, "partition": "debug"}
    if not was_up and os.environ.get("ORCHESTRATE_SLURM_KEEP") != "1":
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)



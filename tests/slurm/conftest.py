"""Fixtures for the SLURM backend tests: the local cluster (scripts/slurm_cluster.sh) for the session.

The cluster needs root and Debian's slurm/munge/mariadb packages: without them the `slurm` tests skip
with the reason, except under CI=true, where they fail instead. A cluster that is already up is reused
and left up; one brought up here is torn down at the end (ORCHESTRATE_SLURM_KEEP=1 keeps it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_helpers import cluster_session


@pytest.fixture(scope="session")
def slurm_cluster():
    yield from cluster_session()

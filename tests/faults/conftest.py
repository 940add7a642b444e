"""The testbeds of the cross-backend suites (fault verdicts, own code): their own sshd hosts (127.0.12.x:2223, so
they never collide with tests/ssh's) and the SLURM testbed cluster (reused when up, torn down when brought up here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _unavailable(why: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"testbed prerequisite missing under CI: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def fault_sshd(tmp_path_factory):
    sys.path.insert(0, str(REPO / "scripts"))
    import sshd_hosts
    why = sshd_hosts.prerequisites()
    if why:
        _unavailable(f"SSH testbed unavailable: {why}")
    d = tmp_path_factory.mktemp("fault-sshd")
    tb = sshd_hosts.up(2, d, base_ip="127.0.12.2", port=2223)
    yield tb
    sshd_hosts.down(d)


@pytest.fixture(scope="session")
def fault_slurm():
    sys.path.insert(0, str(REPO / "tests" / "slurm"))
    from slurm_helpers import CLUSTER_DIR, NODES, SCRIPT, WORK, unavailable
    why = unavailable()
    if why:
        _unavailable(why)
    env = dict(os.environ, ORCHESTRATE_SLURM_DIR=CLUSTER_DIR)
    was_up = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True, text=True).returncode == 0
    if not was_up:
        r = subprocess.run([str(SCRIPT), "up", "--nodes", str(NODES)], env=env, capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            pytest.fail(f"slurm_cluster.sh up failed:\n{r.stdout}\n{r.stderr}")
    os.environ["SLURM_CONF"] = f"{CLUSTER_DIR}/etc/slurm.conf"
    WORK.mkdir(parents=True, exist_ok=True)
    yield
    if not was_up and os.environ.get("ORCHESTRATE_SLURM_KEEP") != "1":
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)

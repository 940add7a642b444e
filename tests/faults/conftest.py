"""The testbeds of the cross-backend suites (fault verdicts, own code): their own sshd hosts (127.0.12.x:2223, so
they never collide with tests/ssh's; ORCHESTRATE_TEST_FAULT_SSH_BASE_IP / _PORT move them, so two checkouts' runs do not
collide either) and the SLURM testbed cluster (reused when up, torn down when brought up here)."""

from __future__ import annotations

import os
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
    tb = sshd_hosts.up(2, d, base_ip=os.environ.get("ORCHESTRATE_TEST_FAULT_SSH_BASE_IP", "127.0.12.2"),
                       port=int(os.environ.get("ORCHESTRATE_TEST_FAULT_SSH_PORT", "2223")))
    yield tb
    sshd_hosts.down(d)


@pytest.fixture(scope="session")
def fault_slurm():
    sys.path.insert(0, str(REPO / "tests" / "slurm"))
    from slurm_helpers import cluster_session
    yield from cluster_session()


@pytest.fixture(scope="session")
def fault_image():
    """The container test image (tests/container_image.py): the `podman` backend of the fault suite."""
    sys.path.insert(0, str(REPO / "tests"))
    from podman_testbed import test_image
    return test_image()

"""Fixtures of the container suite: the test image (tests/podman_testbed.py, built once per stack with no registry)
and a local cluster file that runs jobs in it with podman."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))
from podman_testbed import container_cluster, test_image  # noqa: E402


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.containers)


@pytest.fixture(scope="session")
def image() -> str:
    return test_image()


@pytest.fixture
def podman_cluster(image, tmp_path):
    """podman_cluster(*mounts, **cluster_keys) -> a local cluster file running jobs in the test image."""
    def make(*mounts: str, name: str = "podman", **extra) -> Path:
        return container_cluster(tmp_path / f"{name}.yaml", image, mounts=mounts, **extra)
    return make

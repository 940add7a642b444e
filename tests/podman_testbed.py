"""The container test image (built by scripts/container_image.py) and what the container suites check with podman
(tests/containers, the fault suite's `podman` backend, the SLURM and private-host container tests).

    test_image()                  -> "localhost/orchestrate-test:<key>", built once per stack
                                     (scripts/container_image.py)
    containers_of(job_id)         -> names of the containers (any state) that carry the job's label
    in_image(pid)                 -> the process runs inside the test image (its root holds the image's marker file)
    container_cluster(path, **kw) -> a local cluster file that runs jobs in the test image

Needs root and podman (scripts/install_container_deps.sh). Without them the tests skip with the reason, except under
CI=true, where a missing prerequisite is a failure (the suite must not silently shrink).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))
import container_image  # noqa: E402

MARKER = container_image.MARKER
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def unavailable(reason: str):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"container test prerequisite missing under CI: {reason}", pytrace=False)
    pytest.skip(f"containers unavailable: {reason}")


@functools.cache
def _built() -> str:
    return container_image.build("podman")


def test_image() -> str:
    if os.geteuid() != 0:
        unavailable("needs root (podman as root, ../shared/TESTBED.md)")
    if shutil.which("podman") is None:
        unavailable("podman not installed (scripts/install_container_deps.sh)")
    try:
        return _built()
    except SystemExit as e:
        unavailable(str(e))
        raise


test_image.__test__ = False  # (not a test: pytest collects names starting with test_)


def containers_of(job_id: str) -> list[str]:
    r = subprocess.run(["podman", "ps", "-a", "--filter", f"label=orchestrate.job={job_id}", "--format",
                        "{{.Names}}"], capture_output=True, text=True, timeout=60)
    return r.stdout.split()


def in_image(pid: int) -> bool:
    """The process sees the test image's root filesystem: the marker exists under its root and not on this machine."""
    assert not os.path.exists(MARKER), f"{MARKER} exists on this machine: it would prove nothing"
    return os.path.exists(f"/proc/{pid}/root{MARKER}")


def container_cluster(path: Path, image: str, kind: str = "local", mounts=(), **extra) -> Path:
    import yaml
    data = {"kind": kind, "env": dict(OFFLINE), "container": {"image": image, "runtime": "podman",
                                                               "mounts": list(mounts)}}
    data.update(extra)
    path.write_text(yaml.safe_dump(data))
    return path


def ranks_of(job_id: str) -> dict[int, int]:
    """Global rank -> pid of the job's live ranks on this machine (every testbed host runs here): processes whose
    environment has ORCHESTRATE_JOB_ID=<job> and RANK (the workers)."""
    want = f"ORCHESTRATE_JOB_ID={job_id}".encode()
    out: dict[int, int] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
            if rank is not None and rank.isdigit():
                out.setdefault(int(rank), int(name))
    return out

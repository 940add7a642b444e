"""Plain helpers of the suites that use private SSH hosts (tests/staging, the SSH suite's fault tests on
private hosts, tests/faults/test_faults_private.py): look inside one private host's own view of the filesystem
(its mount namespace), from the submit host, without SSH. Imported under a unique module name (see
tests/ssh/ssh_helpers.py).

    host_run(testbed, host, ["sha256sum", path])      -> CompletedProcess (argv run via nsenter in the host's view)
    host_read_bytes(testbed, host, path)              -> bytes (FileNotFoundError if the host has no such file)
    host_write_bytes(testbed, host, path, data)       (e.g. to corrupt a staged file)
    host_path(testbed, host, path)                    -> Path under /proc/<sshd pid>/root (direct access)

and bring-up / teardown of a private testbed of a test's own: private_up(n, dir, base_ip, port), private_down(tb).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))
import pytest  # noqa: E402
import sshd_hosts  # noqa: E402


def unavailable(reason: str):
    """Skip, or fail under CI=true (the suite must not silently shrink), as tests/ssh/conftest.py does."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"private SSH testbed prerequisite missing under CI: {reason}", pytrace=False)
    pytest.skip(f"private SSH testbed unavailable: {reason}")


def private_up(n: int, d, base_ip: str, port: int, hide=()) -> "sshd_hosts.Testbed":
    """sshd_hosts.up(private=True), or skip (fail under CI) when this machine cannot run it. `hide`: more
    directories of the submitter to hide (pytest's basetemp, in case it is not under /tmp)."""
    why = sshd_hosts.prerequisites(private=True)
    if why:
        unavailable(why)
    try:
        return sshd_hosts.up(n, d, base_ip=base_ip, port=port, private=True, hide=list(hide))
    except RuntimeError as e:
        unavailable(str(e))
        raise  # not reached: unavailable() skips or fails


def private_down(tb) -> None:
    """down(), then fail if anything of the hosts' namespaces is left (a process, hence its mounts)."""
    sshd_hosts.down(tb.dir)
    left = sshd_hosts.leftovers(tb)
    if left:
        pytest.fail(f"private hosts left processes (and their mounts) after down(): {left}", pytrace=False)


def host_run(testbed, host: str, argv: Sequence[str], input: bytes | None = None, timeout: float = 60.0,
             check: bool = False) -> subprocess.CompletedProcess:
    """argv run as root in `host`'s mount namespace (`nsenter --target <its sshd> --mount`); stdout/stderr bytes."""
    pid = sshd_hosts.host_pid(testbed, host)
    return subprocess.run(["nsenter", "--target", str(pid), "--mount", "--", *argv], input=input,
                          capture_output=True, timeout=timeout, check=check, cwd="/")


def host_read_bytes(testbed, host: str, path: str) -> bytes:
    r = host_run(testbed, host, ["cat", "--", path])
    if r.returncode != 0:
        raise FileNotFoundError(f"{host}:{path}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def host_write_bytes(testbed, host: str, path: str, data: bytes) -> None:
    r = host_run(testbed, host, ["sh", "-c", 'cat > "$1"', "sh", path], input=data)
    if r.returncode != 0:
        raise OSError(f"{host}:{path}: {r.stderr.decode(errors='replace').strip()}")


def host_path(testbed, host: str, path: str) -> Path:
    """`path` as the host sees it, reachable from here through /proc/<its sshd pid>/root (valid while it runs)."""
    return Path(f"/proc/{sshd_hosts.host_pid(testbed, host)}/root") / path.lstrip("/")

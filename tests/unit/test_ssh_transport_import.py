"""The SSH backend loads paramiko without `invoke` (launchers.ssh.transport._import_paramiko): paramiko's ssh_config
reader imports it only for `Match exec` lines, which nothing of ours reads, and it costs ~50 ms of CPU (asyncio,
unittest.mock) at every SSH submit, status and cancel. paramiko must still work, and `invoke` stay importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import launchers.ssh.transport as t
loaded = sorted(m for m in ("invoke", "asyncio", "unittest.mock") if m in sys.modules)
key = t.paramiko.Ed25519Key.from_private_key_file  # (paramiko is whole: its key classes, its client)
assert t.paramiko.SSHClient and t.paramiko.config.invoke is None
import invoke  # anything else may still import it
print("LOADED", loaded, "LATER", invoke.__name__)
"""


def test_paramiko_loads_without_invoke_and_invoke_stays_importable():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED [] LATER invoke" in out.stdout, out.stdout

"""The pre-flight checks a node agent runs on its host before anything starts (SSH backend).

`probe(workdir, port, check_file)` -> {"python", "version", "workdir" (resolved), "problems": [...]}: accelerate
importable, the work dir creatable and writable, the main port free (main node only), the shared run dir
visible (shared_fs). The agent started with `--probe` prints the result as one `ORCHESTRATE_PROBE {json}` line,
then waits on stdin: a line (the secrets) means go, EOF means another host failed and nothing starts. One SSH
exec per host does both the pre-flight and the start (each exec costs a remote shell start-up).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import tempfile
from typing import Any

PROBE_MARK = "ORCHESTRATE_PROBE "


def probe(workdir: str, port: int = 0, check_file: str = "") -> dict[str, Any]:
    r: dict[str, Any] = {"python": sys.executable, "version": sys.version.split()[0], "problems": []}
    try:
        if importlib.util.find_spec("accelerate") is None:
            raise ImportError("not installed")
    except Exception as e:  # noqa: BLE001 - a broken install raises anything
        r["problems"].append(f"remote python {sys.executable} cannot import accelerate ({e})")
    try:
        wd = os.path.realpath(os.path.expanduser(workdir))
        os.makedirs(wd, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", dir=wd)
        os.close(fd)
        os.unlink(tmp)
        r["workdir"] = wd
    except OSError as e:
        r["problems"].append(f"workdir {workdir} not writable ({e.strerror or e})")
    if port:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            r["problems"].append(f"main port {port} is in use on the main node ({e.strerror or e})")
        finally:
            s.close()
    if check_file and not os.path.isfile(check_file):
        r["problems"].append(f"shared_fs: {check_file} is not visible on this host")
    return r

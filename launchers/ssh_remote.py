"""Fixed remote programs of the SSH backend (pre-flight probe, teardown) and how they are invoked.

Owns the text that runs on the remote hosts besides the node agent. Nothing here contains user data:
the programs are constants, their arguments go through `remote_command` (shlex-quoted argv).
"""

from __future__ import annotations

import json
from typing import Any

from launchers.ssh_transport import remote_command

# Runs as `PYTHON - WORKDIR PORT CHECK_FILE` with this text on stdin; prints one JSON object.
PREFLIGHT = r"""
import importlib, importlib.util, json, os, socket, sys, tempfile
workdir, port, check_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r = {"python": sys.executable, "version": sys.version.split()[0], "problems": []}
for mod in ("orchestrator", "accelerate"):
    try:
        if mod == "orchestrator":
            importlib.import_module(mod)
        elif importlib.util.find_spec(mod) is None:
            raise ImportError("not installed")
    except Exception as e:
        r["problems"].append("remote python %s cannot import %s (%s)" % (sys.executable, mod, e))
try:
    wd = os.path.realpath(os.path.expanduser(workdir))
    os.makedirs(wd, mode=0o700, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".probe-", dir=wd)
    os.close(fd)
    os.unlink(probe)
    r["workdir"] = wd
except OSError as e:
    r["problems"].append("workdir %s not writable (%s)" % (workdir, e.strerror or e))
if port:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError as e:
        r["problems"].append("main port %d is in use on the main node (%s)" % (port, e.strerror or e))
    finally:
        s.close()
if check_file and not os.path.isfile(check_file):
    r["problems"].append("shared_fs: %s is not visible on this host" % check_file)
print(json.dumps(r))
"""


def preflight_command(python: str, workdir: str, port: int, check_file: str = "") -> str:
    return remote_command([python, "-", workdir, str(port), check_file])


def parse_preflight(python: str, rc: int, out: bytes, err: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(probe result, None) or (None, one-line cause)."""
    tail = err.decode(errors="replace").strip().splitlines()
    last = tail[-1] if tail else ""
    if rc == 127:
        return None, f"remote python {python!r} not found ({last})" if last else f"remote python {python!r} not found"
    if rc == 126:
        return None, f"remote python {python!r} is not executable ({last})"
    if rc != 0:
        return None, f"pre-flight probe with {python!r} failed, exit {rc}: {last}"
    try:
        return json.loads(out.decode().strip().splitlines()[-1]), None
    except (ValueError, IndexError):
        return None, f"pre-flight probe with {python!r} printed no result: {last}"


# Runs as `sh -c TEARDOWN teardown WRAPPER_PID GRACE_S PGID...` (dash: no `kill --`): TERM (+CONT, so stopped processes
# see it) every process group of the job, KILL what is left after the grace, report "gone"/"left N".
# The wrapper is `setsid -w` (started by sshd); its child is the agent's session and group leader.
TEARDOWN = r"""
wrapper=$1; grace=$2; shift 2
groups="$*"
if [ "$wrapper" -gt 0 ] 2>/dev/null; then
  groups="$groups $(ps -o pid= --ppid "$wrapper" 2>/dev/null)"
fi
groups=$(echo $groups)
[ -n "$groups" ] || { echo gone; exit 0; }
alive() {
  ps -e -o pgid=,stat= | awk -v g=" $groups " 'index(g, " " $1 " ") && $2 !~ /^Z/ {n++} END {exit n ? 0 : 1}'
}
for g in $groups; do kill -TERM "-$g" 2>/dev/null; kill -CONT "-$g" 2>/dev/null; done
end=$(( $(date +%s%N) + $(awk -v g="$grace" 'BEGIN {printf "%d", g * 1000000000}') ))
while alive && [ "$(date +%s%N)" -lt "$end" ]; do sleep 0.05; done
if alive; then
  for g in $groups; do kill -KILL "-$g" 2>/dev/null; done
  sleep 0.1
fi
if alive; then echo "left"; else echo "gone"; fi
"""


def teardown_command(wrapper_pid: int | None, pgids: list[int], grace_s: float, python: str | None = None,
                     run_dir: str | None = None, rank: int | None = None) -> str:
    """Kill the recorded groups; then (with python/run_dir) the agent's `--kill` reaps every process that
    carries the launch's marker: torchrun starts ranks in sessions of their own, outside those groups."""
    cmd = remote_command(["sh", "-c", TEARDOWN, "teardown", str(int(wrapper_pid or 0)), f"{grace_s:g}",
                          *[str(int(p)) for p in pgids if p and int(p) > 1]])
    if python and run_dir and rank is not None:
        cmd += " ; " + remote_command([python, "-m", "orchestrator.node_agent", run_dir, "--node-rank", str(rank),
                                       "--kill", "--grace", f"{grace_s:g}"])
    return cmd


# Lists which of the given process groups still have a live (non-zombie) process: "PGID PID STAT CMD".
SCAN = r"""
groups=" $* "
ps -e -o pgid=,pid=,stat=,comm= | awk -v g="$groups" 'index(g, " " $1 " ") && $3 !~ /^Z/'
"""


def scan_command(pgids: list[int]) -> str:
    return remote_command(["sh", "-c", SCAN, "scan", *[str(int(p)) for p in pgids]])

"""Fixed remote programs of the SSH backend (teardown, scan), how they are invoked, and reading a failed probe.

Owns the text that runs on the remote hosts besides the node agent. Nothing here contains user data:
the programs are constants, their arguments go through `remote_command` (shlex-quoted argv).
"""

from __future__ import annotations

from launchers.ssh_transport import remote_command

def probe_failure(python: str, rc: int, output: str) -> str:
    """One-line cause for an agent that ended without printing its probe result (`output`: what it printed)."""
    tail = output.strip().splitlines()
    last = tail[-1] if tail else ""
    missing = next((line for line in tail if "No module named" in line), "")
    if rc == 127:
        return f"remote python {python!r} not found ({last})" if last else f"remote python {python!r} not found"
    if rc == 126:
        return f"remote python {python!r} is not executable ({last})"
    if missing:
        return f"remote python {python!r} cannot import orchestrator ({missing.split(': ', 1)[-1]})"
    if rc != 0:
        return f"pre-flight probe with {python!r} failed, exit {rc}: {last}"
    return f"pre-flight probe with {python!r} printed no result: {last}"


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

"""What runs on the remote hosts of the SSH backend and how it is invoked and read back.

Owns: the backend's one shell line around the node agent's argv (node.agent.agent_argv) (`agent_shell`,
which prints the wrapper's pid first), reading an agent's pre-flight answer off its channel (`await_probe`,
`probe_failure` for one that ended without one), naming a remote exit status (`describe_exit`), and the fixed
remote programs besides the node agent (teardown, scan) with their invocations. Nothing here contains user
data: the programs are constants, their arguments go through `remote_command` (shlex-quoted argv).
paramiko stays unimported until a command is built (`remote_command` is imported where it is used).
"""

from __future__ import annotations

import json
import signal as _signal
import socket
from typing import Any

WRAPPER_MARK = "@@orchestrate-wrapper "


def agent_shell(argv: tuple[str, ...]) -> str:
    """The only shell string of the backend: print the wrapper's pid, then exec the quoted argv."""
    from launchers.ssh.transport import remote_command
    return f'echo "{WRAPPER_MARK}$$"; ' + remote_command(argv)


def describe_exit(rc: int | None) -> tuple[str, int | None]:
    if rc is None or rc < 0:
        return "lost (no exit status: connection closed or killed by a signal)", None
    if rc > 128 and rc - 128 < 65:
        sig = rc - 128
        try:
            return f"exit code {rc} ({_signal.Signals(sig).name})", sig
        except ValueError:
            return f"exit code {rc} (signal {sig})", sig
    return f"exit code {rc}", None


def close_channel(chan: Any) -> None:
    try:
        if chan is not None:
            chan.close()
    except Exception:  # noqa: BLE001 - connection already gone
        pass


def await_probe(chan: Any, python: str, timeout: float, initial: bytes = b"") -> dict[str, Any]:
    """Read an agent's output up to its `ORCHESTRATE_PROBE {json}` line: {"probe", "wrapper_pid", "rest"}, or
    {"why": one-line cause} when it ended (or went quiet) without one. `initial`: what was already read off the
    channel (a staging session that became the agent)."""
    from orchestrator.node.probe import PROBE_MARK
    chan.settimeout(timeout)
    buf, wrapper, seen = initial, None, []
    try:
        while True:
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                text = raw.decode(errors="replace").strip()
                if text.startswith(WRAPPER_MARK):
                    try:
                        wrapper = int(text[len(WRAPPER_MARK):])
                    except ValueError:
                        pass
                elif text.startswith(PROBE_MARK):
                    try:
                        return {"probe": json.loads(text[len(PROBE_MARK):]), "wrapper_pid": wrapper, "rest": buf}
                    except ValueError:
                        return {"why": f"pre-flight probe with {python!r} printed a malformed result: {text[:200]}"}
                elif text:
                    seen.append(text)
            data = chan.recv(65536)
            if not data:
                break
            buf += data
    except socket.timeout:
        return {"why": f"no pre-flight answer from {python!r} within {timeout:.0f}s"}
    return {"why": probe_failure(python, chan.recv_exit_status(), "\n".join(seen + [buf.decode(errors="replace")]))}


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


# Runs as `sh -c UNSTAGE unstage RUN_DIR`: a start that did not happen (a refused pre-flight, a cancel) leaves no run
# dir on a host where staging already linked the job's files: its links (staged/<label>, output) and then its
# directories go, only while empty (a run dir holding anything else, an earlier attempt's records, keeps it).
# The staged files stay in the host's cache (content-addressed, reused by the next submit; `orchestrate gc`).
UNSTAGE = r"""
run=$1
case $run in "~"/*) run="$HOME/${run#\~/}";; esac
[ -d "$run" ] || exit 0
find "$run" -type l -delete 2>/dev/null
find "$run" -depth -type d -empty -delete 2>/dev/null
[ -e "$run" ] && echo kept || echo gone
"""


def unstage_command(run_dir: str) -> str:
    from launchers.ssh.transport import remote_command
    return remote_command(["sh", "-c", UNSTAGE, "unstage", run_dir])


def teardown_command(wrapper_pid: int | None, pgids: list[int], grace_s: float, python: str | None = None,
                     run_dir: str | None = None, rank: int | None = None, prefix: tuple[str, ...] = ()) -> str:
    """Kill the recorded groups; then (with python/run_dir) the agent's `--kill` reaps every process that
    carries the launch's marker: torchrun starts ranks in sessions of their own, outside those groups. `prefix`: what
    goes before python on a host running a staged node package (its PYTHONPATH)."""
    from launchers.ssh.transport import remote_command
    cmd = remote_command(["sh", "-c", TEARDOWN, "teardown", str(int(wrapper_pid or 0)), f"{grace_s:g}",
                          *[str(int(p)) for p in pgids if p and int(p) > 1]])
    if python and run_dir and rank is not None:
        from orchestrator.node.agent import agent_argv
        cmd += " ; " + remote_command(tuple(prefix) + agent_argv(python, run_dir, node_rank=rank, action="kill",
                                                                 grace=grace_s))
    return cmd

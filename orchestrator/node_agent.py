"""The node agent: runs on every node (local, SSH host, SLURM task) and owns that node's launch.

`python -m orchestrator.node_agent RUN_DIR [--node-rank R] [--main-ip IP] [--watch-stdin]
[--secrets-stdin] [--parent-pid PID]`

It binds the facts only the node knows (its rank from --node-rank / SLURM_NODEID, the main address
from SLURM_JOB_NODELIST), writes the node's accelerate config, runs `accelerate launch` in a new
process group, records that group, forwards signals (USR2 to the ranks only, so the launcher itself
survives a preemption notice), and leaves nothing behind: when the launch ends, when it is told to
stop, when its controlling connection (stdin) or parent dies, the whole group is TERMed then KILLed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from orchestrator.hostlist import first_host
from orchestrator.jobplan import LATE_MAIN_IP, LaunchPlan
from orchestrator.proctools import alive, group_members, kill_group, signal_group

RANK_ENV = ("SLURM_NODEID", "ORCHESTRATE_NODE_RANK")
NODELIST_ENV = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")


class AgentError(Exception):
    pass


def bind_rank(arg: int | None, env: dict[str, str], nodes: int) -> int:
    """The node's rank: --node-rank, else SLURM_NODEID / ORCHESTRATE_NODE_RANK, else 0 for one node."""
    if arg is not None:
        rank = arg
    else:
        found = next((env[k] for k in RANK_ENV if env.get(k, "").strip()), None)
        if found is None:
            if nodes == 1:
                return 0
            raise AgentError(f"cannot tell this node's rank: pass --node-rank or set one of {', '.join(RANK_ENV)}")
        try:
            rank = int(found)
        except ValueError:
            raise AgentError(f"node rank {found!r} from the environment is not an integer") from None
    if not 0 <= rank < nodes:
        raise AgentError(f"node rank {rank} out of range for a {nodes}-node job")
    return rank


def bind_main_ip(arg: str | None, plan_main: str, env: dict[str, str]) -> str:
    if arg:
        return arg
    if plan_main != LATE_MAIN_IP:
        return plan_main
    nodelist = next((env[k] for k in NODELIST_ENV if env.get(k)), None)
    if not nodelist:
        raise AgentError("the main address is chosen by the scheduler but SLURM_JOB_NODELIST is not set; "
                         "pass --main-ip")
    return first_host(nodelist)


def rebase(argv: tuple[str, ...], planned_dir: str, actual_dir: str) -> list[str]:
    """Point paths under the planned run dir at where the run dir actually is on this node."""
    if planned_dir == actual_dir:
        return list(argv)
    return [actual_dir + a[len(planned_dir):] if a.startswith(planned_dir) else a for a in argv]


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class Agent:
    def __init__(self, run_dir: Path, plan: LaunchPlan, rank: int, main_ip: str, grace: float = 5.0):
        self.run_dir, self.plan, self.rank, self.main_ip, self.grace = run_dir, plan, rank, main_ip, grace
        self.node_dir = run_dir / "nodes" / str(rank)
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.stop_reason = ""

    def write_config(self) -> Path:
        from orchestrator.render import HEADER, _yaml
        node = self.plan.node(self.rank)
        cfg = dict(node.accelerate_config, machine_rank=self.rank, main_process_ip=self.main_ip)
        text = HEADER.format(job=self.plan.job_id, rank=self.rank, nodes=self.plan.nodes) + _yaml(cfg)
        path = self.node_dir / "accelerate.yaml"
        self.node_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(".yaml.tmp")
            tmp.write_text(text)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        return path

    def environment(self, secrets: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.plan.node(self.rank).env)
        env.update(ORCHESTRATE_RUN_DIR=str(self.run_dir), ORCHESTRATE_JOB_ID=self.plan.job_id,
                   ORCHESTRATE_NODE_RANK=str(self.rank), ORCHESTRATE_ACCELERATOR=self.plan.accelerator,
                   ORCHESTRATE_HEARTBEAT_DIR=str(self.run_dir / "heartbeats"), PYTHONUNBUFFERED="1")
        env.update(secrets)
        return env

    def start(self, secrets: dict[str, str]) -> None:
        self.write_config()
        (self.run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
        argv = rebase(self.plan.node(self.rank).command, self.plan.run_dir, str(self.run_dir))
        self.proc = subprocess.Popen(argv, env=self.environment(secrets), start_new_session=True,
                                     stdin=subprocess.DEVNULL)
        write_json(self.node_dir / "agent.json", {
            "agent_pid": os.getpid(), "agent_pgid": os.getpgrp(), "pid": self.proc.pid, "pgid": self.proc.pid,
            "host": socket.gethostname(), "node_rank": self.rank, "main_ip": self.main_ip, "started": time.time()})

    def forward(self, signum: int) -> None:
        """USR2 (preemption notice) goes to the ranks only; TERM/INT/HUP stop the whole group."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        if signum == signal.SIGUSR2:
            for pid in group_members(pgid):
                if pid != self.proc.pid:
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
            return
        self.stop(f"signal {signal.Signals(signum).name}", first=signum)

    def stop(self, reason: str, first: int = signal.SIGTERM) -> None:
        if self.stopping.is_set() or self.proc is None:
            return
        self.stop_reason = reason
        self.stopping.set()
        pgid = self.proc.pid
        signal_group(pgid, first)

        def escalate() -> None:
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and group_members(pgid):
                time.sleep(0.05)
            signal_group(pgid, signal.SIGKILL)
        threading.Thread(target=escalate, daemon=True).start()

    def watch_stdin(self) -> None:
        def run() -> None:
            try:
                while sys.stdin.buffer.read1(4096) if hasattr(sys.stdin.buffer, "read1") else sys.stdin.read(1):
                    pass
            except (OSError, ValueError):
                pass
            self.stop("controlling connection closed (stdin EOF)")
        threading.Thread(target=run, daemon=True).start()

    def watch_parent(self, ppid: int) -> None:
        def run() -> None:
            while alive(ppid) and os.getppid() == ppid:
                time.sleep(0.2)
            self.stop(f"parent process {ppid} is gone")
        threading.Thread(target=run, daemon=True).start()

    def wait(self) -> int:
        assert self.proc is not None
        while True:
            try:
                rc = self.proc.wait()
                break
            except InterruptedError:
                continue
        # Nothing of the job may outlive the launch: reap stragglers of the group.
        kill_group(self.proc.pid, grace=min(self.grace, 2.0))
        sig = -rc if rc < 0 else None
        code = 128 + sig if sig else rc
        write_json(self.node_dir / "exit.json", {"returncode": code, "signal": sig, "time": time.time(),
                                                 "stop_reason": self.stop_reason})
        return code


def read_secrets_line() -> dict[str, str]:
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return {}
    data = json.loads(line)
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise AgentError("--secrets-stdin expects one JSON object of string values")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.node_agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--node-rank", type=int, default=None)
    ap.add_argument("--main-ip", default=None)
    ap.add_argument("--watch-stdin", action="store_true", help="tear the job down when stdin hits EOF")
    ap.add_argument("--secrets-stdin", action="store_true", help="read one JSON line of secret env from stdin")
    ap.add_argument("--parent-pid", type=int, default=None, help="tear the job down when this pid dies")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds between TERM and KILL")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir).expanduser().resolve()
    try:
        plan = LaunchPlan.from_json((run_dir / "plan.json").read_text())
        rank = bind_rank(args.node_rank, dict(os.environ), plan.nodes)
        main_ip = bind_main_ip(args.main_ip, plan.main_host, dict(os.environ))
        secrets = read_secrets_line() if args.secrets_stdin else {}
    except (AgentError, OSError, ValueError, KeyError) as e:
        print(f"orchestrate node agent: {e}", file=sys.stderr)
        return 2
    agent = Agent(run_dir, plan, rank, main_ip, grace=args.grace)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: agent.forward(s))
    agent.start(secrets)
    if args.watch_stdin:
        agent.watch_stdin()
    if args.parent_pid:
        agent.watch_parent(args.parent_pid)
    return agent.wait()


if __name__ == "__main__":
    sys.exit(main())

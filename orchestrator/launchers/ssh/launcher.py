"""SSH backend: runs one node agent per host over paramiko, streams its output, fails fast, no orphans.

Owns `SSHLauncher` (prepare / preflight / submit / wait / teardown / status / cancel / logs) for `kind: ssh`;
a running job's state and per-node I/O: launchers/ssh_job.py; remote argv, probe, teardown: ssh_remote.py.
submit = connect to ALL hosts and exec on each, once, `setsid -w PYTHON -m orchestrator.node.agent RUN_DIR
--node-rank R --watch-stdin --secrets-stdin ... --probe {...}`: the agent pre-flights its host
(orchestrator.node.probe), prints the result and waits. Any bad host: every channel is closed, the waiting
agents see stdin EOF and exit, nothing started anywhere. All good: copy the run dir's files to each host (SFTP,
0700/0600; skipped with shared_fs), then send each agent its secrets as one JSON line on stdin: the go (one exec
per host: each exec costs a remote login-shell start-up). wait = live output (`[host node/R] ...`) to a callback
and RUN_DIR/logs/node<R>.log; the first node that fails is the root cause and every node's process groups get
TERM, then KILL after a grace. If this process dies, the agents see EOF on stdin and tear their nodes down.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from orchestrator.core.health import HealthMonitor
from orchestrator.types import JobHandle, JobResult, NodeCommand, NodeExit, Submission
from orchestrator.launchers.ssh.job import (Job, Node, copy_run_dir, diagnose_hang, exit_times, fetch_back, node_at_host,
                               node_at_rank, pick_root_cause, pump, rank_at_host, read_agent)
from orchestrator.launchers.ssh.remote import (AGENT_MODULE, agent_argv, agent_shell, await_probe, close_channel, describe_exit,
                                  teardown_command)
from orchestrator.supervise import root_cause_text
from orchestrator.errors import LaunchError, PreflightError, Problem
from orchestrator.core.jobplan import LaunchPlan

logger = logging.getLogger("orchestrate.ssh")
DEFAULT_SECRETS = ("HF_TOKEN", "WANDB_API_KEY")
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "PASSWORD")
GRACE_S = 2.0  # cancel / Ctrl-C: TERM, then KILL after this (ranks may checkpoint on TERM)
FAILFAST_GRACE_S = 1.0  # a node failed: the others cannot finish a collective anyway


def is_secret_name(name: str) -> bool:
    n = name.upper()
    return n in DEFAULT_SECRETS or n.endswith(SECRET_SUFFIXES)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


class SSHLauncher:
    kind = "ssh"

    def __init__(self, cluster: Any, *, grace_s: float = GRACE_S, failfast_grace_s: float = FAILFAST_GRACE_S,
                 local_run_dir: str | None = None,
                 agent_module: str = AGENT_MODULE):
        self.cluster = cluster
        self.local_run_dir = local_run_dir  # default: the run dir itself (shared_fs) or STORE_HOME/runs/<job>
        self.agent_module = agent_module  # tests swap in a stand-in agent
        self.ssh = _get(cluster, "ssh")
        if self.ssh is None:
            raise PreflightError(Problem("ssh", "cluster kind ssh needs an ssh: block"))
        self.grace_s = grace_s
        self.failfast_grace_s = min(failfast_grace_s, grace_s)
        self._jobs: dict[str, Job] = {}

    # ------------------------------------------------------------------ pure
    def _workdir(self, host: str) -> str:
        return str(_get(self.ssh, "workdir", "~/orchestrate")).replace("{host}", host)

    def _hosts(self) -> list[str]:
        hosts = _get(self.ssh, "hosts", ()) or ()
        return [hosts] if isinstance(hosts, str) else list(hosts)

    def prepare(self, plan: LaunchPlan) -> Submission:
        """Per-host argv and what goes where. Pure: no I/O, no connection."""
        shared = bool(_get(self.ssh, "shared_fs", False))
        python = str(_get(self.ssh, "python", "python3"))
        hosts = self._hosts()
        nodes, copies, run_dirs = [], {}, {}
        for np_ in plan.node_plans:
            host = np_.host or (hosts[np_.node_rank] if np_.node_rank < len(hosts) else "")
            run_dir = plan.run_dir if shared else f"{self._workdir(host)}/runs/{plan.job_id}"
            probe = {"workdir": self._workdir(host), "port": int(plan.port) if np_.node_rank == 0 else 0,
                     "check": f"{run_dir}/plan.json" if shared else ""}
            argv = agent_argv(python, run_dir, np_.node_rank, self.agent_module, probe)
            nodes.append(NodeCommand(node_rank=np_.node_rank, host=host, argv=argv, env=dict(np_.env),
                                     secret_env=tuple(plan.secret_env)))
            run_dirs[np_.node_rank] = run_dir
            copies[np_.node_rank] = [] if shared else ["recipe.yaml", "plan.json", f"nodes/{np_.node_rank}/"]
        extra = {"job_id": plan.job_id, "local_run_dir": self.local_run_dir or (plan.run_dir if shared else None), "main_host": plan.main_host, "port": plan.port, "shared_fs": shared,
                 "python": python, "remote_run_dirs": run_dirs, "copy": copies,
                 "ssh": {"port": _get(self.ssh, "port", 22), "user": _get(self.ssh, "user"),
                         "strict_host_keys": _get(self.ssh, "strict_host_keys", True)}}
        return Submission(kind="ssh", run_dir=plan.run_dir, nodes=tuple(nodes), files={}, extra=extra)

    # ------------------------------------------------------------------ pre-flight
    def _static_problems(self, sub: Submission) -> list[Problem]:
        problems = []
        hosts = [n.host for n in sub.nodes]
        if any(not h for h in hosts):
            problems.append(Problem("ssh.hosts", f"{len(sub.nodes)} nodes requested but only "
                                    f"{sum(1 for h in hosts if h)} hosts given"))
        dups = sorted({h for h in hosts if h and hosts.count(h) > 1})
        if dups:
            problems.append(Problem("ssh.hosts", f"duplicate hosts: {', '.join(dups)} (one node per host)"))
        for n in sub.nodes:
            bad = sorted(k for k in n.env if is_secret_name(k))
            if bad:
                problems.append(Problem(f"node {n.node_rank} env", f"secret-looking names {', '.join(bad)} "
                                        "must go through launch.secret_env, not plain env"))
            for name in n.secret_env:
                if name not in os.environ:
                    problems.append(Problem("launch.secret_env", f"{name} is not set in the submit environment"))
        if not sub.extra.get("shared_fs"):
            local = self._local(sub)
            for n in sub.nodes:
                for rel in sub.extra["copy"][n.node_rank]:
                    if not (local / rel).exists():
                        problems.append(Problem(str(local / rel), "missing in the local run dir"))
        return problems

    def preflight(self, sub: Submission):
        """Connect to ALL hosts and start each one's agent in probe mode: it checks its host, reports, and waits.
        Any bad host: every agent is told to stand down (stdin EOF, nothing started anywhere) and PreflightError
        names each bad host. Returns (pool, {host: {"probe", "chan", "wrapper_pid", "rest"}})."""
        from orchestrator.launchers.ssh.transport import HostError, Pool, SSHOptions

        problems = self._static_problems(sub)
        if problems:
            raise PreflightError(sorted(set(problems), key=problems.index))
        try:
            pool = Pool(SSHOptions.from_spec(self.ssh))
        except FileNotFoundError as e:
            raise PreflightError(Problem("ssh", str(e))) from None
        except ValueError as e:
            raise PreflightError(Problem("ssh.key", str(e))) from None
        by_host = {n.host: n for n in sub.nodes}
        python = sub.extra["python"]
        chans: dict[str, Any] = {}

        def probe(host: str) -> dict[str, Any]:
            conn = pool.connect(host)
            chan = chans[host] = conn.open(agent_shell(by_host[host].argv), combine_stderr=True)
            out = await_probe(chan, python, max(conn.timeout, 30.0))
            if out.get("why"):
                raise HostError(host, out["why"])
            if out["probe"]["problems"]:
                raise HostError(host, "; ".join(out["probe"]["problems"]))
            return dict(out, chan=chan)

        results = pool.map(probe, list(by_host))
        for host, res in results.items():
            if isinstance(res, HostError):
                problems.append(Problem(host, res.cause))
            elif isinstance(res, Exception):
                problems.append(Problem(host, f"{type(res).__name__}: {res}"))
        if problems:
            for chan in chans.values():
                close_channel(chan)  # stdin EOF: every waiting agent exits without starting anything
            pool.close()
            raise PreflightError(problems)
        return pool, results

    # ------------------------------------------------------------------ submit
    def submit(self, submission: Submission) -> JobHandle:
        sub = submission
        t0 = time.time()
        pool, probes = self.preflight(sub)
        timeline = {"submitted": t0, "preflight_done": time.time()}  # connect + agents probing every host
        job_id = sub.extra["job_id"]
        shared = sub.extra["shared_fs"]
        local = self._local(sub)
        nodes = []
        for n in sub.nodes:
            run_dir = sub.extra["remote_run_dirs"][n.node_rank]
            wd = self._workdir(n.host)
            real = probes[n.host]["probe"].get("workdir") or wd
            if not shared and run_dir.startswith(wd):  # "~" etc. resolved by the host itself
                run_dir = real + run_dir[len(wd):]
            nodes.append(Node(rank=n.node_rank, host=n.host, run_dir=run_dir, argv=tuple(n.argv),
                              chan=probes[n.host]["chan"], wrapper_pid=probes[n.host]["wrapper_pid"],
                              pending=probes[n.host]["rest"]))
        job = Job(job_id, local, nodes, pool, shared)
        (local / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            if not shared:
                bad = pool.map(lambda h: copy_run_dir(pool.conns[h], local, sub.extra["copy"][rank_at_host(nodes, h)],
                                                      node_at_host(nodes, h).run_dir), [n.host for n in nodes])
                errs = [(h, e) for h, e in bad.items() if isinstance(e, Exception)]
                if errs:
                    h, e = errs[0]
                    raise LaunchError(f"copying the run dir failed: {e}", host=h)
            timeline["copied"] = time.time()
            secrets = {name: os.environ[name] for n in sub.nodes for name in n.secret_env if name in os.environ}
            for name in DEFAULT_SECRETS:
                if name in os.environ:
                    secrets.setdefault(name, os.environ[name])
            line = (json.dumps(secrets) + "\n").encode()
            started = pool.map(lambda h: self._start(job, node_at_host(nodes, h), line), [n.host for n in nodes])
            errs = [(h, e) for h, e in started.items() if isinstance(e, Exception)]
            if errs:
                self._teardown(job, "start failed")
                h, e = errs[0]
                raise LaunchError(f"starting the node agent failed: {e}", host=h,
                                  argv=list(node_at_host(nodes, h).argv))
            timeline["agents_exec"] = time.time()
        except BaseException:
            for n in nodes:
                close_channel(n.chan)
            pool.close()
            raise
        self._jobs[job_id] = job
        logger.debug("submit timeline: %s", {k: round(v - t0, 3) for k, v in timeline.items()})
        return JobHandle(uri=f"ssh://{job_id}", data={**self._handle_data(job), "timeline": timeline})

    @staticmethod
    def _local(sub: Submission) -> Path:
        """Where the submit host's copy of the run dir is (written by the store before submit)."""
        if sub.extra.get("local_run_dir"):
            return Path(sub.extra["local_run_dir"])
        from orchestrator.store import home
        return home() / "runs" / sub.extra["job_id"]

    def _handle_data(self, job: Job) -> dict[str, Any]:
        return {"job_id": job.job_id, "local_run_dir": str(job.local_run_dir),
                "nodes": [{"rank": n.rank, "host": n.host, "run_dir": n.run_dir, "wrapper_pid": n.wrapper_pid,
                           "pgids": n.pgids} for n in job.nodes]}

    def _start(self, job: Job, node: Node, secrets_line: bytes) -> None:
        """Go: the agent waiting since its probe gets the secrets line and starts the launch."""
        node.chan.sendall(secrets_line)  # stdin stays open: its EOF tells the agent to tear down
        threading.Thread(target=pump, args=(job, node), daemon=True,
                         name=f"ssh-node{node.rank}").start()

    # ------------------------------------------------------------------ wait / teardown
    def wait(self, handle: JobHandle, on_line: Callable[[int, str], None] | None = None) -> JobResult:
        job = self._jobs[handle.data.get("job_id") or handle.uri.split("://", 1)[1]]
        if job.result is not None:
            return job.result
        try:
            plan = LaunchPlan.from_json((job.local_run_dir / "plan.json").read_text())
            job.monitor = HealthMonitor(plan.health, plan.world_size, started=time.time())
            hb_every = float(plan.health.poll_interval)
        except (OSError, ValueError, KeyError):
            hb_every = None
        job.set_sink(on_line or (lambda r, line: None))
        failed: list[Node] = []
        pending = {n.rank for n in job.nodes}
        last_poll = last_hb = 0.0
        try:
            while pending:
                try:
                    rank = job.events.get(timeout=0.1)
                except queue.Empty:
                    rank = None
                now = time.monotonic()
                if now - last_poll > 0.25 and job.teardown_started is None:
                    last_poll = now
                    for n in job.nodes:
                        if not n.agent and not n.done.is_set():
                            read_agent(job, n)
                if hb_every and job.monitor and job.teardown_started is None and now - last_hb > hb_every:
                    last_hb = now
                    stalls = job.monitor.stalls(time.time())
                    if stalls:
                        job.hang = diagnose_hang(job, stalls, str(_get(self.ssh, "python", "python3")))
                        job.teardown_started = now
                        self._teardown(job, "hang: " + job.hang)
                if rank is None:
                    if job.teardown_started and now - job.teardown_started > self.grace_s + 15:
                        break  # a host that does not answer any more; give up waiting for it
                    continue
                pending.discard(rank)
                node = job.nodes[rank] if job.nodes[rank].rank == rank else node_at_rank(job.nodes, rank)
                if node.returncode != 0:
                    if job.teardown_started is None or (node.torn_down_at is None):
                        failed.append(node)
                    if job.teardown_started is None:
                        logger.debug("node %d failed (%s): tearing down every node", rank, node.returncode)
                        job.teardown_started = time.monotonic()
                        self._teardown(job, f"node {rank} failed", grace=self.failfast_grace_s)
        except KeyboardInterrupt:
            job.cancel_reason = "interrupted (Ctrl-C) on the submit host"
            self._teardown(job, job.cancel_reason)
            for n in job.nodes:
                n.done.wait(timeout=self.grace_s + 5)
        else:
            if job.teardown_started is None:  # clean finish: sweep leftovers (none expected)
                self._teardown(job, "")
        return self._finish(job, failed)

    def _teardown(self, job: Job, reason: str, grace: float | None = None) -> None:
        """TERM every node's process groups, KILL after the grace; close stdins (agents see EOF)."""
        grace = self.grace_s if grace is None else grace
        if job.teardown_started is None and reason:
            job.teardown_started = time.monotonic()
        for n in job.nodes:
            if not n.agent and reason:
                read_agent(job, n)

        def one(host: str) -> str:
            n = node_at_host(job.nodes, host)
            if reason and not n.done.is_set():
                n.torn_down_at = time.monotonic()
            conn = job.pool.conns.get(host)
            if conn is None or not conn.alive:
                return "no connection"
            t0 = time.monotonic()
            rc, out, err = conn.run(teardown_command(n.wrapper_pid, n.pgids, grace, self.ssh.python, n.run_dir, n.rank),
                                    timeout=2 * grace + 15)
            logger.debug("teardown %s node %d wrapper %s groups %s: rc %s %r %r in %.2fs", host, n.rank, n.wrapper_pid,
                      n.pgids, rc, out, err[-300:], time.monotonic() - t0)
            try:
                if n.chan is not None and not n.done.is_set():
                    n.chan.shutdown_write()
            except Exception:  # noqa: BLE001
                pass
            return out.decode().strip()

        job.pool.map(one, [n.host for n in job.nodes])

    def _finish(self, job: Job, failed: list[Node]) -> JobResult:
        for n in job.nodes:
            n.done.wait(timeout=2)
        exits = tuple(NodeExit(node_rank=n.rank, host=n.host, returncode=n.returncode,
                               signal=describe_exit(n.returncode)[1], log_tail="\n".join(n.tail))
                      for n in job.nodes)
        fetch_back(job)
        for fh in job.hb_files.values():
            fh.close()
        max_step = max((st.step for st in job.monitor.snapshot()), default=None) if job.monitor else None
        if job.cancel_reason:
            state, rc, cause = "CANCELLED", 130, job.cancel_reason
        elif job.hang:
            state, rc, cause = "FAILED", 1, job.hang
        elif failed or any(n.returncode != 0 for n in job.nodes):
            root = pick_root_cause(failed or [n for n in job.nodes if n.returncode != 0],
                                   exit_times(job))
            cause = root_cause_text(next(e for e in exits if e.node_rank == root.rank))
            if root.returncode is None or root.returncode < 0:
                cause = f"node {root.rank} ({root.host}) failed: {describe_exit(root.returncode)[0]}"
            state, rc = "FAILED", (root.returncode if root.returncode and root.returncode > 0 else 1)
        else:
            state, rc, cause = "COMPLETED", 0, ""
        job.pool.close()
        job.state = state
        job.result = JobResult(state=state, returncode=rc, root_cause=cause, nodes=exits, max_step=max_step,
                               hung=bool(job.hang))
        return job.result

    # ------------------------------------------------------------------ the rest of the protocol
    def status(self, handle: JobHandle) -> str:
        job = self._jobs.get(handle.data.get("job_id", ""))
        return job.state if job else "UNKNOWN"

    def cancel(self, handle: JobHandle) -> None:
        job = self._jobs.get(handle.data.get("job_id", ""))
        if job is not None:
            if job.result is None:
                job.cancel_reason = job.cancel_reason or "cancelled"
                self._teardown(job, "cancelled")
            return
        self._cancel_remote(handle)

    def _cancel_remote(self, handle: JobHandle) -> None:
        """Cancel from another process: reconnect, read each node's agent.json, kill its groups."""
        from orchestrator.launchers.ssh.transport import Pool, SSHOptions

        nodes = handle.data.get("nodes", [])
        pool = Pool(SSHOptions.from_spec(self.ssh))
        try:
            def one(host: str) -> None:
                n = next(x for x in nodes if x["host"] == host)
                conn = pool.connect(host)
                pgids = list(n.get("pgids") or [])
                try:
                    with conn.sftp() as sftp, sftp.open(f"{n['run_dir']}/nodes/{n['rank']}/agent.json", "rb") as fh:
                        a = json.loads(fh.read().decode())
                    pgids += [v for v in (a.get("agent_pgid"), a.get("pgid")) if isinstance(v, int)]
                except (OSError, ValueError):
                    pass
                conn.run(teardown_command(n.get("wrapper_pid"), sorted(set(pgids)), self.grace_s, self.ssh.python,
                                          n["run_dir"], n["rank"]))

            pool.map(one, [n["host"] for n in nodes])
        finally:
            pool.close()

    def logs(self, handle: JobHandle, node_rank: int | None = None) -> Iterator[str]:
        local = Path(handle.data.get("local_run_dir", ""))
        ranks = [node_rank] if node_rank is not None else [n["rank"] for n in handle.data.get("nodes", [])]
        for r in ranks:
            p = local / "logs" / f"node{r}.log"
            if p.exists():
                with open(p, errors="replace") as fh:
                    for line in fh:
                        yield line.rstrip("\n")

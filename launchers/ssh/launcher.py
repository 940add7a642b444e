"""SSH backend: one node agent per host over paramiko, output streamed, torn down on command, no orphans.

Owns `SSHLauncher` for `kind: ssh`: prepare (pure: each host's agent argv, what is copied where), the pre-flight
of every host and the start (submit), and status / cancel / logs from another process. A running job is an
`SSHJob` (launchers/ssh/job.py) that the one supervisor (orchestrator.supervise) drives; remote programs and argv
helpers: launchers/ssh/remote.py. submit = connect to ALL hosts and exec on each, once, `setsid -w PYTHON -m
orchestrator.node RUN_DIR --node-rank R --watch-stdin --secrets-stdin --forward-heartbeats --probe {...}`: the
agent pre-flights its host (orchestrator.node.probe), prints the result and waits. Any bad host: every channel is
closed, the waiting agents see stdin EOF and exit, nothing started anywhere. All good: copy the run dir's files to
each host (SFTP, 0700/0600; skipped with shared_fs), then send each agent its secrets as one JSON line on stdin:
the go. If this process dies, the agents see EOF on stdin and tear their nodes down.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

from orchestrator.core.jobplan import LaunchPlan
from orchestrator.core.schema import is_secret_name
from orchestrator.core.leases import busy_error_text, lease_request
from orchestrator.errors import LaunchError, LeasesBusy, PreflightError, Problem
from launchers.base import container_problems, ensure_open_files, record_container, run_dir_logs, status_from_nodes
from launchers.ssh.job import Node, SSHJob, copy_run_dir, node_at_host, rank_at_host
from launchers.ssh.remote import (WRAPPER_MARK, agent_shell, await_probe, close_channel, teardown_command,
                                  unstage_command)
from launchers.ssh.stage import agent_prefix
from orchestrator.node.agent import EMULATE_FLAG, MODULE, agent_argv
from orchestrator.node.emulate import EMULATE_VAR
from orchestrator.node.rundir import RunDir
from orchestrator.types import JobHandle, JobStatus, NodeCommand, Submission

logger = logging.getLogger("orchestrate.ssh")
DEFAULT_SECRETS = ("HF_TOKEN", "WANDB_API_KEY")
GRACE_S = 2.0  # the agents' own TERM -> KILL grace


@dataclass
class Waiting:
    """A QUEUED job's look, kept until its next one: the connections, each host's agent (probing, its lease dropped,
    waiting on its channel for {"retry": true}, the go, or EOF) and what staging made for it (docs/CONTRACT.md
    "Leases"). The next look asks the same agents again instead of connecting, staging and starting them anew."""

    job: str
    pool: Any
    sub: Submission
    staged: dict[str, Any] | None
    linked: dict[str, str]
    results: dict[str, Any]  # host -> its last probe: {"probe", "chan", "wrapper_pid", "rest"}
    launcher: "SSHLauncher"

    def alive(self) -> bool:
        return all(isinstance(r, dict) and not r["chan"].closed and not r["chan"].exit_status_ready()
                   for r in self.results.values())

    def close(self) -> None:
        """Given up (cancelled, `--no-wait`, another job's look): every agent sees EOF and exits, having started
        nothing; the connections close and nothing of the job is left on a host."""
        with self.launcher._lock:
            if self.launcher._waiting is self:
                self.launcher._waiting = None
        for r in self.results.values():
            if isinstance(r, dict):
                close_channel(r["chan"])
        self.launcher._give_up(self.pool, None, self.linked)


class SSHLauncher:
    kind = "ssh"

    def __init__(self, cluster: Any, *, grace_s: float = GRACE_S, agent_module: str = MODULE):
        self.cluster = cluster
        self.agent_module = agent_module  # tests swap in a stand-in agent
        self.ssh = getattr(cluster, "ssh", None)
        if self.ssh is None:
            raise PreflightError(Problem("ssh", "cluster kind ssh needs an ssh: block"))
        self.grace_s = grace_s
        self._waiting: Waiting | None = None  # a QUEUED job's kept look (preflight, LeasesBusy.kept)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ pure
    def _workdir(self, host: str) -> str:
        return str(self.ssh.workdir).replace("{host}", host)

    def remote_run_dir(self, plan: LaunchPlan, host: str) -> str:
        return plan.run_dir if self.ssh.shared_fs else f"{self._workdir(host).rstrip('/')}/runs/{plan.job_id}"

    def prepare(self, plan: LaunchPlan) -> Submission:
        """Per-host argv and what goes where. Pure: no I/O, no connection."""
        shared, python, hosts = bool(self.ssh.shared_fs), str(self.ssh.python), list(self.ssh.hosts)
        nodes, copies, run_dirs = [], {}, {}
        for np_ in plan.node_plans:
            host = np_.host or (hosts[np_.node_rank] if np_.node_rank < len(hosts) else "")
            run_dir = self.remote_run_dir(plan, host)
            probe = {"workdir": self._workdir(host), "port": int(plan.port) if np_.node_rank == 0 else 0,
                     "check": f"{run_dir}/{RunDir.PLAN}" if shared else ""}
            probe.update(probe_network_gpus(plan, np_.env))
            if plan.container is not None and plan.container.agent_side:  # the stack is checked in the image
                probe.update(container=plan.container.to_dict(), needed=list(plan.needed()))
            lease = lease_request(plan, np_.node_rank)  # taken by the agent as it probes (docs/CONTRACT.md "Leases")
            if lease is not None:
                probe["lease"] = lease
            prefix = agent_prefix(self._workdir(host), plan.node_package) if plan.node_package and not shared else ()
            argv = ("setsid", "-w") + prefix + agent_argv(python, run_dir, node_rank=np_.node_rank, watch_stdin=True,
                                                 secrets_stdin=True, forward_heartbeats=True, grace=self.grace_s,
                                                 probe=probe, module=self.agent_module)
            nodes.append(NodeCommand(node_rank=np_.node_rank, host=host, argv=argv, env=dict(np_.env),
                                     secret_env=tuple(plan.secret_env)))
            run_dirs[np_.node_rank] = run_dir
            copies[np_.node_rank] = [] if shared else [RunDir.RECIPE, RunDir.PLAN, f"{RunDir.NODES}/{np_.node_rank}/"]
        extra = {"job_id": plan.job_id, "main_host": plan.main_host, "port": plan.port, "shared_fs": shared,
                 "python": python, "remote_run_dirs": run_dirs, "copy": copies, "package": plan.node_package,
                 "workdirs": {n.node_rank: self._workdir(n.host) for n in nodes},
                 "deepspeed": plan.distributed_type == "DEEPSPEED",
                 "container": plan.container.to_dict() if plan.container is not None else None}
        if plan.accelerator == "gpu":  # what the pre-flight compares with each host's GPUs (gpu_problems, gpu_health)
            extra["gpus"] = {"procs_per_node": plan.procs_per_node, "gpu_ids": list(plan.gpu_ids),
                             "allow_idle": plan.allow_idle_gpus, "declared": getattr(self.ssh, "gpus_per_node", None),
                             "gpu_check": plan.health.gpu_check, "gpu_diag": plan.health.gpu_diag,
                             "xid_lookback_s": plan.health.xid_lookback_s}
        return Submission(kind="ssh", run_dir=plan.run_dir, nodes=tuple(nodes), files={}, extra=extra)

    # ------------------------------------------------------------------ pre-flight
    def _static_problems(self, sub: Submission, local: RunDir) -> list[Problem]:
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
            for n in sub.nodes:
                for rel in sub.extra["copy"][n.node_rank]:
                    if not local.path(rel).exists():
                        problems.append(Problem(str(local.path(rel)), "missing in the local run dir"))
        return problems

    def preflight(self, sub: Submission, local: RunDir, pool: Any = None, sessions: dict[str, Any] | None = None,
                  kept: dict[str, dict[str, Any]] | None = None):
        """Connect to ALL hosts and start each one's agent in probe mode: it checks its host, reports, and waits.
        Any bad host: every agent is told to stand down (stdin EOF, nothing started anywhere) and PreflightError
        names each bad host. Returns (pool, {host: {"probe", "chan", "wrapper_pid", "rest"}}). Hosts leased by another
        job (and none bad): every agent drops what it leased ({"release": true}) and waits on its open channel, and
        LeasesBusy carries them (`kept`, what the next look of this job passes back: each agent is asked again with
        {"retry": true}, no new connection, staging or agent; docs/CONTRACT.md "Leases")."""
        from launchers.ssh.transport import HostError

        problems = self._static_problems(sub, local)
        if problems:
            raise PreflightError(sorted(set(problems), key=problems.index))
        pool = pool or self.pool()
        by_host = {n.host: n for n in sub.nodes}
        python = sub.extra["python"]
        chans: dict[str, Any] = {}

        def probe(host: str) -> dict[str, Any]:
            conn = pool.conns.get(host)
            if conn is None or not conn.alive:
                conn = pool.connect(host)
            initial = b""
            if kept and host in kept:  # the job's earlier look: its agent waits on this channel, its lease dropped
                chan = kept[host]["chan"]
                chan.sendall(b'{"retry": true}\n')
            elif sessions and host in sessions:  # the host's staging session becomes its agent: one remote start
                chan, initial = sessions.pop(host).exec(by_host[host].argv, WRAPPER_MARK)
            else:
                chan = conn.open(agent_shell(by_host[host].argv), combine_stderr=True)
            chans[host] = chan
            out = await_probe(chan, python, max(conn.timeout, 30.0), initial)
            if kept and host in kept:  # (its wrapper's pid was read by the first look)
                out["wrapper_pid"] = out.get("wrapper_pid") or kept[host].get("wrapper_pid")
            if out.get("why"):
                raise HostError(host, out["why"])
            if out["probe"]["problems"]:
                raise HostError(host, "; ".join(out["probe"]["problems"]))
            return dict(out, chan=chan)

        results = pool.map(probe, list(by_host))
        bad_hosts: dict[str, str] = {}  # what a spare host could fix (the host itself cannot run the job)
        for host, res in results.items():
            if isinstance(res, HostError):
                problems.append(Problem(host, res.cause))
                bad_hosts[host] = res.cause
            elif isinstance(res, Exception):
                problems.append(Problem(host, f"{type(res).__name__}: {res}"))
                bad_hosts[host] = f"{type(res).__name__}: {res}"
        if not problems and sub.extra.get("gpus"):
            from orchestrator.core.gpuhealth import kernel_log_note
            probes = {h: r["probe"] for h, r in results.items()}
            problems.extend(gpu_problems(sub.extra["gpus"], probes))
            health = gpu_health(sub.extra["gpus"], probes)
            if health is not None:
                refused, warned, excluded = health
                problems.extend(Problem(f.host, f.text()) for f in refused + [w for w in warned if w.host in excluded])
                bad_hosts.update({h: "; ".join(f.text() for f in warned if f.host == h) for h in excluded})
                for f in warned:
                    if f.host not in excluded:
                        logger.warning("GPU health (health.gpu_check: warn): %s: %s", f.host, f.text())
                notes = {h: n for h, r in probes.items() if (n := kernel_log_note(h, r.get("gpu_health") or {}))}
                for note in notes.values():
                    logger.warning("GPU health: %s", note)
                local.write_json("gpu_health.json", {h: {"findings": [f.text() for f in warned + refused
                                                                      if f.host == h],
                                                         "excluded": h in excluded} | (
                                                             {"note": notes[h]} if h in notes else {})
                                                     for h in probes})
        checks = {h: r["probe"]["container"] for h, r in results.items() if isinstance(r, dict)
                  and "container" in r["probe"]}
        if not problems and checks:
            problems.extend(container_problems(sub.extra["container"]["image"], checks))
        busy = [r["probe"]["busy"] for r in results.values() if isinstance(r, dict) and r["probe"].get("busy")]
        if busy and not problems:  # QUEUED: every agent holds nothing and waits for the next look (or EOF)
            for sent in pool.map(lambda h: chans[h].sendall(b'{"release": true}\n'), list(chans)).values():
                if isinstance(sent, Exception):
                    break
            else:
                for session in list((sessions or {}).values()):
                    session.close()
                raise LeasesBusy(busy, busy_error_text(busy), kept=results)
        if problems or busy:
            for chan in chans.values():
                close_channel(chan)  # stdin EOF: every waiting agent exits without starting anything
            for session in list((sessions or {}).values()):
                session.close()
            pool.close()
            if not problems:  # every host can run it, some are leased by another job: the api waits (QUEUED)
                raise LeasesBusy(busy, busy_error_text(busy))
            raise PreflightError(problems, bad_hosts=bad_hosts)
        if checks:
            record_container(local, sub.extra["container"], checks)
        return pool, results

    def _give_up(self, pool: Any, sessions: dict[str, Any] | None, linked: dict[str, str]) -> None:
        """A start that will not happen: its sessions and connections closed (each waiting agent sees EOF and exits,
        having started nothing) and nothing of the job left on a host."""
        for session in list((sessions or {}).values()):  # a cancelled map's threads may still pop from it
            session.close()
        pool.close()
        self.unstage(linked)

    def _wait(self, waiting: "Waiting", cancel: threading.Event | None) -> None:
        """Keep a QUEUED job's look for its next one (submit takes it); a cancel meanwhile gives it up."""
        with self._lock:
            self._waiting = waiting
        if cancel is None:
            return  # (nobody cancels it: the process's end closes the connections)

        def watch() -> None:
            while self._waiting is waiting:
                if cancel.wait(1.0):
                    if self._waiting is waiting:
                        waiting.close()
                    return
        threading.Thread(target=watch, daemon=True, name="ssh-queued").start()

    def unstage(self, run_dirs: dict[str, str]) -> None:
        """Remove the job's run dir from each host where staging linked it ({host: remote run dir}; remote.UNSTAGE:
        its links and empty directories), over fresh connections (the submit's are closed). Best effort: a host that
        cannot be cleaned is named in a warning (`orchestrate gc` removes it later)."""
        if not run_dirs:
            return
        try:
            pool = self.pool()
        except PreflightError as e:
            logger.warning("could not remove the staged run dir of a job that did not start: %s", e.one_line())
            return
        try:
            done = pool.map(lambda h: pool.connect(h).run(unstage_command(run_dirs[h]), timeout=15), list(run_dirs))
        finally:
            pool.close()
        for host, res in done.items():
            if isinstance(res, BaseException) or res[0] != 0:
                why = res if isinstance(res, BaseException) else f"exit {res[0]}"
                logger.warning("%s: could not remove %s of a job that did not start: %s", host, run_dirs[host], why)

    def pool(self):
        from launchers.ssh.transport import Pool
        try:
            return Pool(self.ssh)
        except FileNotFoundError as e:
            raise PreflightError(Problem("ssh", str(e))) from None
        except ValueError as e:
            raise PreflightError(Problem("ssh.key", str(e))) from None

    def stage(self, sub: Submission, local: RunDir, pool: Any, linked: dict[str, str] | None = None
              ) -> tuple[Submission, dict[str, Any], dict[str, Any]]:
        """Hosts without a shared filesystem (docs/staging.md): the node package and the job's inputs into each
        host's cache (only what it lacks), the job's links, every host's facts checked first. Returns the
        submission with each host's workdir bound (`~` resolved there), what was staged, and each host's open staging
        session (the pre-flight turns it into the host's agent). `linked` gets {host: remote run dir} once the job's
        links are made there (what `unstage` removes when the start does not happen)."""
        from launchers.ssh import stage as st
        doc = local.read_json(st.STAGE_FILE)
        if not isinstance(doc, dict):
            raise PreflightError(Problem(str(local.path(st.STAGE_FILE)), "missing or unreadable (render it again)"))
        t0 = time.time()
        cache = st.hash_cache()
        cache.cancel = pool.cancel
        pkg = st.package_tree(cache)
        if pkg.sha != sub.extra["package"]:
            raise PreflightError(Problem("orchestrator", "the installed orchestrate changed since the job was "
                                                         "prepared: submit again"))
        layout = st.Layout(tuple(st.Source(d["label"], d["path"], d["kind"], tuple(d["files"]))
                                 for d in doc["sources"]), doc["output_local"], doc["output_key"], doc["fetch"],
                           doc["stage"], tuple(doc["inputs"]))
        try:
            trees = [pkg] + st.source_trees(layout, cache)
        except OSError as e:
            raise PreflightError(Problem(getattr(e, "filename", None) or "staging",
                                         f"cannot read: {e.strerror}")) from None
        cache.save()
        job = sub.extra["job_id"]
        links = {f"runs/{job}/staged/{t.label}": t.sha for t in trees[1:]}
        links[f"runs/{job}/output"] = layout.output_key
        needed = () if sub.extra.get("container") else \
            tuple(doc.get("needed", ())) + (("deepspeed",) if sub.extra.get("deepspeed") else ())  # else: in the image
        stager = st.Stager(pool, self.ssh, trees, links, needed)
        hosts = [n.host for n in sub.nodes]
        stager.hello(hosts, () if layout.stage else layout.inputs)
        t_hello = time.time()
        total = sum(dict(stager.blobs)[s] for hs in stager.hosts.values() for s in hs.missing)
        if total > 64 << 20:
            logger.warning("staging %.1f MB to %d host(s) ...", total / 1e6, len(hosts))
        facts = stager.push(on_progress=lambda done, tot: logger.warning("staging: %.0f of %.0f MB", done / 1e6,
                                                                         tot / 1e6))
        if linked is not None:
            linked.update({h: f"{facts[h].workdir.rstrip('/')}/runs/{job}" for h in hosts})
        seeded = self._seed(stager, pool, hosts, facts, layout.output_key, local)
        nodes = []
        for n in sub.nodes:
            wd, real = sub.extra["workdirs"][n.node_rank], facts[n.host].workdir
            argv = tuple(real + a[len(wd):] if a.startswith(wd) else
                         a.replace("=" + wd, "=" + real, 1) if a.startswith("PYTHONPATH=") else a for a in n.argv)
            nodes.append(replace(n, argv=argv))
        extra = dict(sub.extra, remote_run_dirs={r: facts[n.host].workdir + d[len(sub.extra["workdirs"][r]):]
                                                  for r, d, n in ((n.node_rank, sub.extra["remote_run_dirs"][
                                                      n.node_rank], n) for n in sub.nodes)})
        report = {"hosts": {h: {"workdir": f.workdir, "sent_bytes": f.sent_bytes, "sent_files": f.sent_files,
                                "trees_built": f.built, "versions": f.versions} for h, f in facts.items()},
                  "bytes": sum(t.size for t in trees), "files": sum(len(t.entries) for t in trees),
                  "sent_bytes": sum(f.sent_bytes for f in facts.values()), "hello_s": round(t_hello - t0, 3),
                  "seconds": round(time.time() - t0, 3), "output_key": layout.output_key, "fetch": layout.fetch,
                  "output_local": layout.output_local, "seeded": seeded}
        local.write_json("staged.json", report)
        return replace(sub, nodes=tuple(nodes), extra=extra), report, stager.sessions

    def _seed(self, stager: Any, pool: Any, hosts: list[str], facts: dict[str, Any], key: str,
              local: RunDir) -> dict[str, str]:
        """The newest checkpoint onto every host that lacks it (launchers.ssh.stage.seed_checkpoints: a spare that took
        a bad host's place resumes with the others), asked over the hosts' open staging sessions."""
        from launchers.ssh import stage as st
        found = pool.map(lambda h: list(stager.sessions[h].ask({"op": "checkpoints", "dir": key})["steps"]), hosts)
        bad = {h: e for h, e in found.items() if isinstance(e, Exception)}
        if bad:
            raise PreflightError([Problem(h, f"cannot list its checkpoints: {e}") for h, e in bad.items()],
                                 bad_hosts={h: str(e) for h, e in bad.items()})
        import shutil
        try:
            seeded = st.seed_checkpoints(pool, self.ssh, found, {h: facts[h].workdir for h in hosts}, key,
                                         local.path("seed"))
        except (OSError, RuntimeError) as e:
            raise LaunchError(f"carrying the newest checkpoint to a new host failed: {e}") from None
        finally:
            shutil.rmtree(local.path("seed"), ignore_errors=True)
        for host, what in seeded.items():
            logger.warning("%s has no copy of the job's newest checkpoint: %s copied to it", host, what)
        return seeded

    # ------------------------------------------------------------------ submit
    def submit(self, submission: Submission, run_dir: RunDir, cancel: threading.Event | None = None) -> SSHJob:
        """Stage (private hosts), pre-flight every host, copy the run dir, then start every agent at once. Until that
        start, `cancel` set (Ctrl-C) stops it within a poll: every connection closed, so each host's waiting agent
        stands down, and SubmitCancelled raised; after it the supervisor stops the job."""
        sub, local = emulated(submission), run_dir
        raised = ensure_open_files(len(sub.nodes), "an SSH job")
        if raised:
            logger.warning("%s", raised)
        t0 = time.time()
        with self._lock:  # this job's earlier look, if it found hosts leased (QUEUED): its agents wait to be asked
            waiting, self._waiting = self._waiting, None
        if waiting is not None and (waiting.job != sub.extra["job_id"] or not waiting.alive()):
            waiting.close()
            waiting = None
        staged: dict[str, Any] | None = None
        sessions: dict[str, Any] | None = None
        linked: dict[str, str] = {}  # hosts where staging linked the job's files into its run dir
        if waiting is not None:
            pool, sub, staged, linked = waiting.pool, waiting.sub, waiting.staged, waiting.linked
        else:
            pool = self.pool()
        pool.cancel = cancel
        try:
            if waiting is None and sub.extra.get("package") and not sub.extra["shared_fs"]:
                sub, staged, sessions = self.stage(sub, local, pool, linked)
            # (every map of the pool checks `cancel` as it begins and ends, and while it waits)
            pool, probes = self.preflight(sub, local, pool, sessions, kept=waiting.results if waiting else None)
        except LeasesBusy as e:
            if e.kept is None:
                self._give_up(pool, sessions, linked)
                raise
            e.kept = Waiting(sub.extra["job_id"], pool, sub, staged, linked, e.kept, self)  # (the api: close() when
            self._wait(e.kept, cancel)                                                     # it does not wait)
            raise
        except PreflightError:
            self._give_up(pool, sessions, linked)
            if waiting is not None:  # a waiting agent went away meanwhile: look again from the start, once
                return self.submit(submission, run_dir, cancel)
            raise
        except BaseException:
            self._give_up(pool, sessions, linked)
            raise
        timeline = {"submitted": t0, "preflight_done": time.time()}  # connect + agents probing every host
        shared = sub.extra["shared_fs"]
        nodes = []
        for n in sub.nodes:
            remote = sub.extra["remote_run_dirs"][n.node_rank]
            wd = self._workdir(n.host)
            real = probes[n.host]["probe"].get("workdir") or wd
            if not shared and remote.startswith(wd):  # "~" etc. resolved by the host itself
                remote = real + remote[len(wd):]
            nodes.append(Node(rank=n.node_rank, host=n.host, run_dir=remote, argv=tuple(n.argv),
                              chan=probes[n.host]["chan"], wrapper_pid=probes[n.host]["wrapper_pid"],
                              pending=probes[n.host]["rest"]))
        job = SSHJob(sub.extra["job_id"], local, nodes, pool, shared, sub.extra["python"], grace=self.grace_s)
        if staged:
            workdirs = {n.rank: staged["hosts"][n.host]["workdir"] for n in nodes}
            job.outputs = {"ssh": self.ssh, "key": staged["output_key"], "local": staged["output_local"],
                           "fetch": staged["fetch"], "workdirs": workdirs}
        local.mkdir(RunDir.LOGS)
        try:
            if not shared:
                bad = pool.map(lambda h: copy_run_dir(pool.conns[h], local.root,
                                                      sub.extra["copy"][rank_at_host(nodes, h)],
                                                      node_at_host(nodes, h).run_dir), [n.host for n in nodes])
                errs = [(h, e) for h, e in bad.items() if isinstance(e, Exception)]
                if errs:
                    h, e = errs[0]
                    raise LaunchError(f"copying the run dir failed: {e}", host=h)
            timeline["copied"] = time.time()
            pool.check_cancel()
            pool.cancel = None  # from here on the job starts: the supervisor stops it
            secrets = {name: os.environ[name] for n in sub.nodes for name in n.secret_env if name in os.environ}
            for name in DEFAULT_SECRETS:
                if name in os.environ:
                    secrets.setdefault(name, os.environ[name])
            line = (json.dumps(secrets) + "\n").encode()
            job.start()
            started = pool.map(lambda h: node_at_host(nodes, h).chan.sendall(line), [n.host for n in nodes])
            errs = [(h, e) for h, e in started.items() if isinstance(e, Exception)]
            if errs:
                job.stop("start failed", self.grace_s)
                h, e = errs[0]
                raise LaunchError(f"starting the node agent failed: {e}", host=h,
                                  argv=list(node_at_host(nodes, h).argv))
            timeline["agents_exec"] = time.time()
        except BaseException:
            for n in nodes:
                close_channel(n.chan)
            pool.close()
            raise
        logger.debug("submit timeline: %s", {k: round(v - t0, 3) for k, v in timeline.items()})
        job.handle = JobHandle(uri=f"ssh://{job.job_id}", data={
            "job_id": job.job_id, "timeline": timeline,
            "nodes": [{"rank": n.rank, "host": n.host, "run_dir": n.run_dir, "wrapper_pid": n.wrapper_pid,
                       "prefix": list(n.prefix)}
                      | ({"outputs": f"{n.host}:{job.outputs['workdirs'][n.rank]}/{job.outputs['key']}"}
                         if job.outputs else {}) for n in nodes]})
        return job

    # ------------------------------------------------------------------ from any process
    def _each_node(self, handle: JobHandle, fn) -> dict[str, Any]:
        from launchers.ssh.transport import Pool
        nodes = handle.data.get("nodes", [])
        pool = Pool(self.ssh)
        try:
            return pool.map(lambda host: fn(pool.connect(host), next(x for x in nodes if x["host"] == host)),
                            [n["host"] for n in nodes])
        finally:
            pool.close()

    def status(self, handle: JobHandle, run_dir: RunDir) -> JobStatus:
        """Ask every host's agent records (`--status` over SSH); a host that does not answer is `unknown`."""
        from launchers.ssh.transport import remote_command

        def one(conn, n) -> list[dict]:
            rc, out, err = conn.run(remote_command(tuple(n.get("prefix") or ()) + agent_argv(
                self.ssh.python, n["run_dir"], node_rank=n["rank"], action="status")), timeout=30)
            return [json.loads(line) for line in out.decode(errors="replace").splitlines() if line.startswith("{")]

        rows, unreachable = [], {}
        ranks = {n["host"]: n["rank"] for n in handle.data.get("nodes", [])}
        for host, res in self._each_node(handle, one).items():
            if isinstance(res, Exception):
                unreachable[ranks[host]] = f"{host}: {res}"
            else:
                rows += [dict(r, host=host) for r in res]  # the host as the job names it, not the machine's name
        return status_from_nodes(rows, unreachable)

    def cancel(self, handle: JobHandle, run_dir: RunDir) -> None:
        """Cancel from another process: reconnect, read each node's AgentRecord, kill its groups and marked ranks."""
        def one(conn, n) -> None:
            from orchestrator.node.rundir import parse_agent
            pgids: list[int] = []
            try:
                with conn.sftp() as sftp, sftp.open(f"{n['run_dir']}/{RunDir.node_rel(n['rank'], 'agent.json')}",
                                                    "rb") as fh:
                    rec = parse_agent(json.loads(fh.read().decode()))
                pgids = rec.groups() if rec else []
            except (OSError, ValueError):
                pass
            conn.run(teardown_command(n.get("wrapper_pid"), sorted(set(pgids)), self.grace_s, self.ssh.python,
                                      n["run_dir"], n["rank"], tuple(n.get("prefix") or ())))
        self._each_node(handle, one)

    def logs(self, handle: JobHandle, run_dir: RunDir, node: int | None = None) -> Iterator[str]:
        hosts = {n["rank"]: n["host"] for n in handle.data.get("nodes", [])}
        return run_dir_logs(run_dir, node, hosts)


def emulated(sub: Submission) -> Submission:
    """Benchmarks and tests only: ORCHESTRATE_EMULATE set on the submit side reaches every host's agent explicitly
    (`--emulate`; the SSH agents do not inherit the submitter's environment): its ranks are emulated
    (orchestrator.node.emulate). Read at submit, not in the pure prepare: `render` never shows it."""
    spec = os.environ.get(EMULATE_VAR)
    if not spec:
        return sub
    return replace(sub, nodes=tuple(replace(n, argv=tuple(n.argv) + (EMULATE_FLAG, spec)) for n in sub.nodes))


# ------------------------------------------------------------------ pre-flight: network and GPUs (docs/gpus.md)

def probe_network_gpus(plan: LaunchPlan, env: dict[str, str]) -> dict[str, Any]:
    """What a host's probe checks besides reachability: the network interface (a name must exist; auto: the one that
    routes to the main host is found), NCCL_IB_HCA against the host's InfiniBand devices, and for a GPU job the GPU
    inventory."""
    out: dict[str, Any] = {}
    if plan.network_interface:
        out.update(ifname=plan.network_interface, main=plan.main_host)
    if plan.accelerator == "gpu":
        out["gpus"] = True
        out["gpu_health"] = {"diag": plan.health.gpu_diag == "dcgm"}
        if env.get("NCCL_IB_HCA"):
            out["ib_hca"] = env["NCCL_IB_HCA"]
    return out


def gpu_health(want: dict[str, Any], probes: dict[str, dict[str, Any]]):
    """Every host's GPU health (its probe's "gpu_health", orchestrator.node.gpus.health) judged by the one set of
    rules (orchestrator.core.gpuhealth) under health.gpu_check: (refused, warned, hosts to exclude), or None when
    the probes carry no health."""
    from orchestrator.core.gpuhealth import judge, verdict
    if not any("gpu_health" in r for r in probes.values()):
        return None
    used = tuple(want.get("gpu_ids") or ()) or None
    findings = [f for host, r in probes.items() for f in judge(host, r.get("gpu_health") or {}, used,
                                                               want.get("gpu_diag") == "dcgm",
                                                               float(want.get("xid_lookback_s") or 0))]
    return verdict(findings, str(want.get("gpu_check") or "fail"))


def gpu_problems(want: dict[str, Any], probes: dict[str, dict[str, Any]]) -> list[Problem]:
    """The hosts' GPUs against the plan: every host the same count (else named, with their counts and models), the
    `gpus:` indices present, no more processes than GPUs, no GPU idle unless launch.allow_idle_gpus."""
    counts: dict[str, int] = {}
    models: dict[str, str] = {}
    problems: list[Problem] = []
    for host, res in probes.items():
        visible = res.get("visible")
        gpus = res.get("gpus") or []
        counts[host] = len(visible) if visible is not None else len(gpus)
        names = sorted({g.get("name") or "?" for g in gpus})
        models[host] = f"{counts[host]} x {'/'.join(names)}" if gpus else "no GPU" + (
            f" ({res['gpu_error']})" if res.get("gpu_error") else "")
    shown = ", ".join(f"{h} {models[h]}" for h in counts)
    ids, ppn = list(want.get("gpu_ids") or []), int(want["procs_per_node"])
    declared = want.get("declared")
    if ids:
        lacking = [h for h, n in counts.items() if any(g >= n for g in ids)]
        if lacking:
            problems.append(Problem("launch.gpus", f"GPU(s) {','.join(map(str, ids))} asked on every node, but "
                                                   f"{', '.join(lacking)} lack(s) some (hosts: {shown})"))
        avail: int | None = len(ids)
    elif len(set(counts.values())) > 1:
        problems.append(Problem("ssh.hosts", f"the hosts have different GPU counts ({shown}): one process per GPU "
                                             "needs the same number on every node; pick the same GPUs on each with "
                                             "launch.gpus, or use hosts alike"))
        avail = None
    else:
        avail = next(iter(counts.values()), None)
    if declared is not None and any(n != declared for n in counts.values()):
        problems.append(Problem("ssh.gpus_per_node", f"{declared} declared, but the hosts have: {shown}"))
    if avail is not None and not problems:
        if ppn > avail:
            problems.append(Problem("launch.procs_per_node", f"{ppn} processes per node, but each host gives the job "
                                                             f"{avail} GPU(s) (hosts: {shown})"))
        elif ppn < avail and not want.get("allow_idle"):
            problems.append(Problem("launch.procs_per_node", f"{avail - ppn} of the {avail} GPUs of each host would "
                                                             f"be idle (launch.procs_per_node = {ppn}; hosts: {shown}):"
                                                             f" use launch.procs_per_node: auto ({avail} per node), "
                                                             "or set launch.allow_idle_gpus: true"))
    return problems

"""The node agent: runs on every node (local, SSH host, SLURM task) and owns that node's launch.

`python -m orchestrator.node RUN_DIR [--node-rank R] [--main-ip IP] [--watch-stdin] [--secrets-stdin]
[--watch-parent] ...`; `agent_argv` is the one place that argv is spelled.

It binds the facts only the node knows (its rank from --node-rank / SLURM_NODEID, the main address
from SLURM_JOB_NODELIST), writes the node's accelerate config, runs `accelerate launch` in a new
process group, records that group, forwards signals (USR2 to the ranks only, so the launcher itself
survives a preemption notice), and leaves nothing behind: when the launch ends, when it is told to
stop, when its controlling connection (stdin) or parent dies, the whole group is TERMed then KILLed.
Everything it reads and writes in the run dir goes through `RunDir` (its AgentRecord and ExitRecord).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from orchestrator.core.hostlist import first_host
from orchestrator.core.jobplan import AGENT_ENV, LATE_MAIN_IP, RUN_DIR_VAR, LaunchPlan, job_port
from orchestrator.node.proctools import (TOKEN_VAR, alive, become_subreaper, marked, marked_ranks, process_start_time,
                                         ranks_of, signal_group, signal_pids, sweep_launch)
from orchestrator.node.emulate import EMULATE_VAR, Emulation
from orchestrator.node.ranklines import RankRelay
from orchestrator.node.rundir import EXIT_MARK, AgentRecord, ExitRecord, RunDir, write_error

MODULE = "orchestrator.node"  # `python -m orchestrator.node RUN_DIR ...` runs `main` below
HOOKS_DIR = Path(__file__).resolve().parent / "hooks"  # zero-code health hooks for the ranks (sitecustomize)
EARLIER_CONTAINER_GRACE = 30.0  # seconds an earlier attempt's container gets to end (Agent.end_earlier_container)
CONTAINER_DAEMONS = ("podman", "docker")  # runtimes whose `run` ends with the container's code (128+N: killed by N)
KILLED_CONTAINER_WAIT_S = 1.0  # a rank of one died unseen: how long its `podman run` gets to say how, before our KILL
DIAGNOSE_WAIT_S = 5.0  # inside a SLURM allocation: how long the node naming a hang waits for the other nodes' evidence

RANK_ENV = ("SLURM_NODEID", "ORCHESTRATE_NODE_RANK")
EMULATE_FLAG = "--emulate"  # SPEC: ORCHESTRATE_EMULATE for an agent that does not inherit the submitter's env
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


ARRAY_TASK_ENV = "SLURM_ARRAY_TASK_ID"
JOB_ID_ENV = "SLURM_JOB_ID"


def bind_port(plan: LaunchPlan, env: dict[str, str]) -> LaunchPlan:
    """The rendezvous port of a SLURM job, from its allocation: jobs (and the tasks of an array) that SLURM gives the
    same nodes at once (a node with free cores or GPUs runs two) must not meet on one port. A task of an array (a
    sweep's point, launchers.slurm.sbatch.render_array_sbatch) uses launch.port + 1 + its index; any other SLURM job
    whose launch.port was not given (plan.port_per_job) core.jobplan.job_port of its job id (the same on every node
    of the job, and again after a requeue); a given launch.port is used as given. Written into each
    node's accelerate config too. Other backends keep their plan's port."""
    import dataclasses
    task = env.get(ARRAY_TASK_ENV, "").strip()
    job = env.get(JOB_ID_ENV, "").strip() if plan.port_per_job else ""
    if plan.cluster_kind != "slurm" or not (task.isdigit() or job.isdigit()):
        return plan
    port = int(plan.port) + 1 + int(task) if task.isdigit() else job_port(plan.port, job)
    nodes = tuple(dataclasses.replace(n, accelerate_config=dict(n.accelerate_config, main_process_port=port))
                  if "main_process_port" in n.accelerate_config else n for n in plan.node_plans)
    return dataclasses.replace(plan, port=port, node_plans=nodes)


def agent_argv(python: str, run_dir: str, *, node_rank: int | None = None, watch_stdin: bool = False,
               secrets_stdin: bool = False, forward_heartbeats: bool = False, watch_parent: bool = False,
               grace: float | None = None, probe: dict | None = None, action: str | None = None,
               module: str = MODULE) -> tuple[str, ...]:
    """The node agent's argv: the ONE place it is spelled (local, SSH, SLURM, sbatch, teardown, diagnosis).
    `action` is None (run the node), "kill", "diagnose" or "status". (Benchmarks and tests append EMULATE_FLAG SPEC.)"""
    argv = [python, "-m", module, run_dir]
    if node_rank is not None:
        argv += ["--node-rank", str(node_rank)]
    if action:
        argv.append(f"--{action}")
    argv += ["--watch-stdin"] * watch_stdin + ["--secrets-stdin"] * secrets_stdin
    argv += ["--forward-heartbeats"] * forward_heartbeats
    argv += ["--watch-parent"] * watch_parent
    if grace is not None:
        argv += ["--grace", f"{grace:g}"]
    if probe is not None:
        argv += ["--probe", json.dumps(probe, sort_keys=True)]
    return tuple(argv)


class Agent:
    def __init__(self, run_dir: Path, plan: LaunchPlan, rank: int, main_ip: str, grace: float = 5.0,
                 rendered: bool = False, emulation: Emulation | None = None):
        self.rd = RunDir(run_dir)
        self.emulation = emulation  # orchestrator.node.emulate: run emulated ranks instead of the plan's launch
        self.run_dir, self.plan, self.rank, self.main_ip, self.grace = run_dir, plan, rank, main_ip, grace
        self.rendered = rendered  # the run dir's node configs were rendered from this plan as it is (core.render)
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.launch_done = threading.Event()  # set by wait() when the launch has exited
        self.stop_reason = ""
        self.rank_death = None  # orchestrator.node.rankwatch.RankDeath when a rank died before finishing
        self.token = f"{plan.job_id}.{rank}.{os.urandom(6).hex()}"
        self._node_env: dict[str, str] | None = None  # the plan's env for this node, late facts bound (node_checks)
        self.preflight_error = ""  # the network pre-flight stopped this node (watch_main_reachable)
        self.relay: RankRelay | None = None  # node.ranklines.RankRelay: the ranks' output, tagged by rank (start_relay)
        self.subreaper = False  # this process is its launch's child subreaper (main; proctools.sweep_launch)
        self.watch = None  # node.rankwatch.RankWatch once watch_ranks started it: the ranks' pids it found
        self.gpu_fault = ""  # the GPU watch's fatal finding that ended this node (watch_gpus)
        # the lease (node.lease.Held): its descriptors go to the launch (the kernel keeps the lease while any holder
        # lives) and its files name the launch and the ranks (the next taker waits for them): a killed agent's host
        # stays leased until the last process of its job there is gone
        self.lease = None

    @property
    def emulated(self) -> bool:
        """One process stands in for the launch and its ranks (node.emulate): no rank of its own."""
        return self.emulation is not None

    def write_config(self) -> Path:
        """This node's accelerate config with its rank and the main address bound. Where those are the plan's own
        (a local or SSH job) the file the submitter rendered from this very plan is it already: kept as it is, without
        the YAML writer's import (~10 ms of the start)."""
        from orchestrator.core.accelconf import accelerate_config_text
        node = self.plan.node(self.rank)
        cfg = dict(node.accelerate_config, machine_rank=self.rank, main_process_ip=self.main_ip)
        if self.rendered and cfg == node.accelerate_config and self.rd.accelerate_config(self.rank).exists():
            return self.rd.accelerate_config(self.rank)
        text = accelerate_config_text(cfg, self.plan.job_id, self.rank, self.plan.nodes)
        path = self.rd.accelerate_config(self.rank)
        if not path.exists() or path.read_text() != text:
            self.rd.write_text(RunDir.node_rel(self.rank, "accelerate.yaml"), text)
        return path

    def environment(self, secrets: dict[str, str]) -> dict[str, str]:
        """The ranks' environment: this process's, the plan's for this node, orchestrate's own (jobplan.AGENT_ENV),
        the launch's marker and the secrets. In a container the same names are passed in (`container_env_names`) and
        PYTHONPATH points at the node package mounted there (core.container.PYTHONPATH)."""
        env = dict(os.environ)
        env.update(self.node_env())
        own = dict(ORCHESTRATE_RUN_DIR=str(self.run_dir), ORCHESTRATE_JOB_ID=self.plan.job_id,
                   ORCHESTRATE_NODE_RANK=str(self.rank), ORCHESTRATE_ACCELERATOR=self.plan.accelerator,
                   ORCHESTRATE_HEARTBEAT_DIR=str(self.rd.heartbeats), PYTHONUNBUFFERED="1")
        if self.plan.container is not None:
            from orchestrator.core.container import PYTHONPATH
            own["PYTHONPATH"] = PYTHONPATH
        elif HOOKS_DIR.is_dir():  # the ranks' zero-code health hooks (sitecustomize), ahead of the user's path
            own["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOKS_DIR), env.get("PYTHONPATH", "")) if p)
        assert set(own) <= set(AGENT_ENV), "jobplan.AGENT_ENV names what the agent sets"
        env.update(own)
        for name in ("ORCHESTRATE_HOOKS_PID", "RANK", "LOCAL_RANK"):  # set per rank by the hooks / torchrun only
            env.pop(name, None)
        env[TOKEN_VAR] = self.token
        env.update(secrets)
        return env

    def container_env_names(self, secrets: dict[str, str]) -> list[str]:
        """What a container gets passed in by name: the plan's env for this node, orchestrate's own, the secrets, and
        the ORCHESTRATE_* switches of this process's environment (e.g. ORCHESTRATE_HOOKS=0)."""
        names = set(self.node_env()) | set(AGENT_ENV) | set(secrets)
        names |= {n for n in os.environ if n.startswith("ORCHESTRATE_") and n != TOKEN_VAR}
        return sorted(names - {TOKEN_VAR})

    def container_argv(self, inner: list[str], cwd: str | None, secrets: dict[str, str]) -> list[str]:
        """`inner` (the launcher's argv, bound) in this job's container, built by the one builder (core.container)."""
        import dataclasses
        from orchestrator.core.container import Mount, node_argv
        from orchestrator.resources import package_root  # holds orchestrator/ and recipes/ (what a container mounts)
        cp = self.plan.container
        assert cp is not None
        cp = dataclasses.replace(cp, mounts=tuple(Mount(os.path.expanduser(m.host), m.path, m.mode) for m in cp.mounts))
        staged_root = str(self.run_dir.parent.parent) if self.plan.node_package else ""  # WORKDIR: runs, cache, outputs
        return node_argv(cp, inner, job_id=self.plan.job_id, node_rank=self.rank, run_dir=str(self.run_dir),
                         package=str(package_root()), cwd=cwd or os.getcwd(), token=self.token,
                         env_names=self.container_env_names(secrets), roots=(staged_root,) if staged_root else ())

    # ---- network interface and GPUs of this node (docs/gpus.md): bound and checked before the launch starts
    def node_env(self) -> dict[str, str]:
        """The plan's env for this node with the node's own facts bound: ${RUN_DIR}, `network_interface: auto` (the
        interface that routes to the main node), CUDA_VISIBLE_DEVICES mapped through the node's own restriction."""
        if self._node_env is None:
            self.node_checks()
        return dict(self._node_env or {})

    def node_checks(self) -> str | None:
        """Bind the node's env (node_env) and check what the plan needs of this host: the named network interface
        exists, NCCL_IB_HCA names InfiniBand devices it has, the GPUs the plan binds are among those it may use
        and there are enough for its processes. Returns the problem (the node must not start) or None."""
        from orchestrator.node import gpus, netcheck
        host = socket.gethostname()
        env, problem = netcheck.bind_env(self.plan.node(self.rank).env, str(self.run_dir), self.main_ip, host)
        ifname = self.plan.network_interface
        if problem is None and ifname and ifname != "auto":
            problem = netcheck.check_interface(ifname, host)
        hca = env.get("NCCL_IB_HCA") or os.environ.get("NCCL_IB_HCA")
        if problem is None and hca and self.plan.accelerator == "gpu":
            problem = netcheck.check_ib_hca(hca, host)
        if problem is None and self.plan.accelerator == "gpu":
            inherited = gpus.visible(dict(os.environ))  # SLURM's allocation, or the user's own restriction
            planned = env.get("CUDA_VISIBLE_DEVICES")
            if planned is not None and planned == self.plan.node(self.rank).env.get("CUDA_VISIBLE_DEVICES"):
                env["CUDA_VISIBLE_DEVICES"], why = gpus.bind_visible(planned, inherited)
                problem = f"node {self.rank} ({host}): {why}" if why else None
            have = gpus.visible(env)
            count = len(have) if have is not None else gpus.count_visible(dict(os.environ)) if (
                inherited is not None or os.environ.get("SLURM_GPUS_ON_NODE")) else None
            need = len(self.plan.node(self.rank).ranks)
            if problem is None and count is not None and count < need:
                problem = (f"node {self.rank} ({host}) may use {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                           f"{','.join(have or inherited or []) or '(none)'}) but runs {need} process(es), one per GPU")
        if any(v.startswith(str(self.rd.stacks) + "/") for v in env.values()):
            self.rd.mkdir(RunDir.STACKS)  # NCCL's flight recorder dumps there (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)
        self._node_env = env
        return problem

    def gpu_health_check(self) -> str | None:
        """Inside a SLURM allocation, the health of this node's GPUs (orchestrator.core.gpuhealth, health.gpu_check):
        a bad GPU the job uses refuses the node ("GPU health: ..." names GPU, field, value; the restart policy takes the
        node out of the next allocation) unless the policy is warn (said on stderr, the node runs). Local and SSH jobs
        are checked by their launcher's pre-flight instead."""
        if self.plan.accelerator != "gpu" or self.plan.cluster_kind != "slurm":
            return None
        from orchestrator.core.gpuhealth import judge, kernel_log_note, verdict
        from orchestrator.node import gpus
        host = socket.gethostname()
        visible = gpus.visible()  # SLURM's allocation: judge those
        used = tuple(int(v) for v in visible if v.isdigit()) if visible is not None else None
        health = gpus.health(diag=self.plan.health.gpu_diag == "dcgm")
        if note := kernel_log_note(host, health):
            os.write(2, f"orchestrate node agent: warning: GPU health: {note}\n".encode())
        findings = judge(host, health, used, self.plan.health.gpu_diag == "dcgm",
                         float(getattr(self.plan.health, "xid_lookback_s", 0) or 0))
        refused, warned, excluded = verdict(findings, self.plan.health.gpu_check)
        for f in warned:
            if f.host not in excluded:
                os.write(2, f"orchestrate node agent: warning: GPU health: {host}: {f.text()}\n".encode())
        bad = refused + [f for f in warned if f.host in excluded]
        return "GPU health: " + f"node {self.rank} ({host}): " + "; ".join(f.text() for f in bad) if bad else None

    def end_earlier_container(self, runtime: str, name: str) -> None:
        """An earlier attempt's container of this node that is still there: its agent was killed (SLURM's requeue
        kills the step's processes KillWait after its TERM, and the container is no process of the step) while its
        ranks were saving a checkpoint on their stop signal, or never got the signal. It gets EARLIER_CONTAINER_GRACE
        seconds between TERM and KILL to end, so the checkpoint it saves is whole and this attempt resumes from it."""
        from orchestrator.node.containers import leftovers, remove
        if name not in leftovers(runtime, self.plan.job_id):
            return
        os.write(2, f"orchestrate node agent: an earlier attempt's container {name} is still there; it gets up to "
                    f"{EARLIER_CONTAINER_GRACE:g} s to end (a checkpoint it may be saving) before it is removed\n"
                    .encode())
        why = remove(runtime, self.plan.job_id, self.rank, grace=EARLIER_CONTAINER_GRACE)
        if why:
            os.write(2, f"orchestrate node agent: could not remove container {name}: {why}\n".encode())

    def container_check(self) -> str | None:
        """Inside a SLURM allocation nothing checked this node for the job's container before the start (local and SSH
        jobs are checked by their launcher's pre-flight): the runtime, the image, the mounts, the stack in the image.
        Records the image's id and digest (nodes/<R>/container.json). Returns the problem, or None."""
        cp = self.plan.container
        if cp is None or not cp.agent_side or self.plan.cluster_kind != "slurm":
            return None
        from orchestrator.node.containers import preflight
        res = preflight(cp, self.plan.needed())
        try:
            self.rd.write_json(RunDir.node_rel(self.rank, "container.json"),
                               {"runtime": cp.runtime, "image": cp.image,
                                "hosts": {socket.gethostname(): {"image": res["image"], "versions": res["versions"]}}})
        except OSError:
            pass
        return f"node {self.rank} ({socket.gethostname()}): " + "; ".join(res["problems"]) if res["problems"] else None

    def refuse(self, problem: str, code: int = 2, kind: str = "PreflightError") -> int:
        """The node cannot run as planned: say why (one `PreflightError:` line, the supervisor's root cause; a lost
        lease race: `LeaseBusy:`, exit 75), record it in exit.json, start nothing. Returns the exit code."""
        os.write(2, f"{kind}: {problem}\n".encode())
        self.record_exit(ExitRecord(returncode=code, time=time.time(), signal=None, launch_returncode=code,
                                    stop_reason="", preempted=False, hang=None, rank_death=None,
                                    host=socket.gethostname()))
        # (no stop_reason: nobody stopped this node, it failed on its own; the cause is the PreflightError line)
        return code

    def record_exit(self, rec: ExitRecord) -> None:
        """nodes/<R>/exit.json, in the room kept for it (RunDir.write_exit_reserved). Never raises: a record that
        cannot be written (a full disk) is said in one line and printed whole on stdout (rundir.EXIT_MARK), where the
        backend's supervisor reads it, so the node's end stays the real one."""
        why = self.rd.write_exit_reserved(self.rank, rec)
        if why:
            import dataclasses
            os.write(2, f"orchestrate node agent: exit record could not be written: {why}\n".encode())
            line = EXIT_MARK + json.dumps(dataclasses.asdict(dataclasses.replace(rec, unwritten=why)), sort_keys=True)
            os.write(1, ("\n" + line + "\n").encode())

    def watch_main_reachable(self) -> None:
        """A node other than the main one: the main node's rendezvous port must answer within
        health.preflight_timeout (dropped packets) or twice that, at least 60 s (refused: nothing listens); else this
        node stops with the cause named, instead of torchrun's static rendezvous waiting ten minutes."""
        from orchestrator.node.netcheck import wait_reachable
        timeout = float(getattr(self.plan.health, "preflight_timeout", 0) or 0)
        command = self.plan.node(self.rank).command
        if self.rank == 0 or self.plan.nodes < 2 or timeout <= 0 or "accelerate.commands.launch" not in command[:3]:
            return  # (the main node's rendezvous port is torchrun's: only an `accelerate launch` node listens there)
        env = self.node_env()
        via = env.get("NCCL_SOCKET_IFNAME") or env.get("GLOO_SOCKET_IFNAME") or "the default route"

        def run() -> None:
            why = wait_reachable(self.main_ip, int(self.plan.port), timeout, self.stopping)
            if why is None or self.stopping.is_set() or self.launch_done.is_set():
                return
            self.preflight_error = (f"network pre-flight failed: node {self.rank} ({socket.gethostname()}) {why}: the "
                                    f"main node (node 0) does not answer on its rendezvous port (interface {via})")
            os.write(2, f"PreflightError: {self.preflight_error}\n".encode())
            self.stop(f"network pre-flight: {why}")
        threading.Thread(target=run, daemon=True, name="main-reachable").start()

    def watch_gpus(self) -> None:
        """GPU health during the job (orchestrator.node.gpuwatch), every health.gpu_watch_s (0: off), on a GPU node: a
        new fatal finding (host and GPU named) stops this node with that cause, said as one `GpuHealthError:` line."""
        every = float(getattr(self.plan.health, "gpu_watch_s", 0) or 0)
        if every <= 0 or self.plan.accelerator != "gpu":
            return
        from orchestrator.node.gpus import visible
        from orchestrator.node.gpuwatch import GpuWatch
        vis = visible(self.node_env())
        used = tuple(int(v) for v in vis if v.isdigit()) if vis is not None and all(v.isdigit() for v in vis) else None
        watch = GpuWatch(self.rd, self.rank, self.plan.node(self.rank).host or socket.gethostname(), used, every,
                         self.plan.health.gpu_check)

        def run() -> None:
            while not self.stopping.is_set() and not self.launch_done.is_set():
                fault = watch.poll()
                if fault and not self.stopping.is_set() and not self.launch_done.is_set():
                    self.gpu_fault = fault
                    os.write(2, f"GpuHealthError: GPU watch: {fault}\n".encode())
                    self.stop(f"GPU watch: {fault}")
                    return
                self.launch_done.wait(every)
        threading.Thread(target=run, daemon=True, name="gpu-watch").start()

    def start(self, secrets: dict[str, str]) -> bool:
        """Start the launch; False when a stop was asked for before it could start."""
        if self.stopping.is_set():
            return False
        self.write_config()
        self.rd.mkdir(RunDir.HEARTBEATS)
        self.rd.mkdir(RunDir.LOGS)
        self.rd.reserve_exit(self.rank)  # room for the exit record should the disk fill up while the job runs
        for g in self.plan.node(self.rank).ranks:  # an earlier attempt's exit records never speak for this one
            (self.rd.heartbeats / f"rank{g}.exit").unlink(missing_ok=True)
        argv = self.rd.bind(self.plan.node(self.rank).command)
        if self.emulation is not None:  # scale tests and benchmarks: one cheap process for this node's ranks
            argv = self.emulation.argv(self.plan.node(self.rank).ranks)
        recipe = self.rd.path(RunDir.RECIPE)
        if recipe.exists() and RUN_DIR_VAR in (text := recipe.read_text()):  # staged paths (docs/staging.md)
            self.rd.write_text(RunDir.RECIPE, text.replace(RUN_DIR_VAR, str(self.run_dir)))
        cwd = self.rd.bind([self.plan.rank_cwd])[0] if self.plan.rank_cwd else None
        env = self.environment(secrets)
        container = ""
        cp = self.plan.container
        if cp is not None and cp.agent_side:
            from orchestrator.core.container import DAEMON_RUNTIMES, TOKEN_ON_LINE, container_name
            argv = self.container_argv(list(argv), cwd, secrets)
            if cp.runtime in TOKEN_ON_LINE:  # only the container's processes carry it, not the runtime's client
                env.pop(TOKEN_VAR)
            container = container_name(self.plan.job_id, self.rank) if cp.runtime in DAEMON_RUNTIMES else ""
            if container:
                self.end_earlier_container(cp.runtime, container)
        self.start_relay()
        # SLURM signals every process of a step; torchrun has no USR2 handler and would die of it, orphaning
        # the ranks. Ignored dispositions survive exec, so the launcher ignores USR2 and each rank's own
        # handler (the recipes' save-on-signal) replaces the ignore in the ranks.
        try:
            self.proc = subprocess.Popen(argv, env=env, start_new_session=True, cwd=cwd if not container else None,
                                         stdin=subprocess.DEVNULL, preexec_fn=_child_setup,
                                         pass_fds=tuple(self.lease.fds) if self.lease is not None else ())
        except BaseException:
            self.close_relay()
            raise
        try:
            self.rd.write_agent(AgentRecord(
                node_rank=self.rank, host=socket.gethostname(), agent_pid=os.getpid(), agent_pgid=os.getpgrp(),
                pid=self.proc.pid, pgid=self.proc.pid, main_ip=self.main_ip, started=time.time(),
                agent_proc_start=process_start_time(), proc_start=process_start_time(self.proc.pid), token=self.token,
                container=container, runtime=cp.runtime if cp is not None else ""))
        except OSError as e:  # (a full disk) the agent still owns and tears down its launch; `--kill` from outside
            os.write(2, f"orchestrate node agent: agent record could not be written: {write_error(e)}\n".encode())
        self.note_lease([])
        if self.stopping.is_set():  # a signal raced the start
            self.stopping.clear()
            self.stop(self.stop_reason or "stopped during start")
        return True

    def note_lease(self, ranks: list[int]) -> None:
        """The lease's files name the launch and `ranks` (pids) with their start times (node.lease.Held.note)."""
        if self.lease is not None and self.proc is not None:
            self.lease.note([[p, process_start_time(p)] for p in [self.proc.pid, *ranks]])

    def start_relay(self) -> None:
        """Per-rank output (node.ranklines): one pipe per rank of this node, each line passed on tagged `[rankG]: `."""
        relay = RankRelay(self.rd.rank_pipes(self.rank), list(self.plan.node(self.rank).ranks))
        why = relay.open()
        if why:
            os.write(2, f"orchestrate node agent: warning: output not tagged by rank: {why}\n".encode())
            return
        relay.start()
        self.relay = relay

    def close_relay(self) -> None:
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.close()

    def forward(self, signum: int) -> None:
        """USR2 (preemption notice) goes to the ranks only; TERM/INT/HUP stop the whole group."""
        if self.proc is None:
            if signum != signal.SIGUSR2:
                self.stop_reason = f"signal {signal.Signals(signum).name} before start"
                self.stopping.set()
            return
        if signum == signal.SIGUSR2:
            signal_pids([p for p in marked(self.token) if p != self.proc.pid], signum)
            return
        self.stop(f"signal {signal.Signals(signum).name}", first=signum)

    def stop(self, reason: str, first: int = signal.SIGTERM) -> None:
        if self.stopping.is_set() or self.proc is None:
            return
        self.stop_reason = reason
        self.stopping.set()
        pgid = self.proc.pid
        signal_group(pgid, first)
        known = self.known_ranks()
        # The ranks live in sessions of their own (torchrun): those the rank watch holds, else one scan of /proc (every
        # process's environment: on loopback hosts sharing one /proc, every agent's scan reads every host's).
        pids = known if known is not None else marked(self.token)
        signal_pids(pids, first)
        signal_pids(pids, signal.SIGCONT)  # a stopped (hung) rank must run to act on TERM

        def escalate() -> None:
            deadline = time.monotonic() + self.grace
            if known is not None:  # a look at each known rank, no scan; wait()'s sweep finds anything else
                left = [p for p in known if alive(p)]
                while left and time.monotonic() < deadline:
                    time.sleep(0.05)
                    left = [p for p in left if alive(p)]
                signal_group(pgid, signal.SIGKILL)
                signal_pids(left, signal.SIGKILL)
                return
            left = pids
            # Until every rank is gone (saved or not): the launcher then has nothing left to wait for. (Each look is
            # a scan of every process on the host: what it found is what gets the KILL.)
            while ranks_of(left) and time.monotonic() < deadline:
                time.sleep(0.05)
                left = marked(self.token)
            signal_group(pgid, signal.SIGKILL)
            signal_pids(left, signal.SIGKILL)  # (anything that appeared since: wait()'s sweep after the launch)
        threading.Thread(target=escalate, daemon=True).start()

    def known_ranks(self) -> list[int] | None:
        """The pids of this node's rank processes when every one is known without a scan: those the rank watch found
        (it holds a pidfd on each once it found them all), or none of its own for an emulated node. None: not known."""
        if self.emulated:
            return []
        watch = self.watch
        if watch is None:
            return None
        pids = dict(watch.pids)
        return list(pids.values()) if len(pids) == len(watch.ranks) else None

    def watch_ranks(self) -> None:
        """Fail fast: a rank of this node that dies before finishing ends the node at once (node.rankwatch),
        instead of after torchrun's own poll, error report and exit. Its peers on this node are blocked on it and
        a checkpoint cannot complete without it: KILL, no grace."""
        from orchestrator.node.rankwatch import RankWatch
        watch = RankWatch(self.token, list(self.plan.node(self.rank).ranks), self.rd.heartbeats,
                          found=lambda pids: self.note_lease(sorted(pids.values())))
        self.watch = watch

        def run() -> None:
            death = watch.wait(lambda: self.stopping.is_set() or self.launch_done.is_set())
            if death is None or self.stopping.is_set() or self.proc is None:
                return
            self.rank_death = death
            self.stop_reason = death.describe()
            self.stopping.set()
            if death.status is None and self.container_runtime() in CONTAINER_DAEMONS:
                # a rank of a container reaped there (its status unknown here): `podman kill` of the container ends
                # its `podman run` with 128+N within moments; that code (read in wait) says how, ours would hide it
                self.launch_done.wait(KILLED_CONTAINER_WAIT_S)
            os.write(2, f"orchestrate node agent: {death.describe()}; stopping node {self.rank} now\n".encode())
            signal_group(self.proc.pid, signal.SIGKILL)
            known = self.known_ranks()
            signal_pids(marked(self.token) if known is None else known, signal.SIGKILL)
        threading.Thread(target=run, daemon=True, name="rank-watch").start()

    def watch_stdin(self) -> None:
        """The controlling connection (SSH): a line `{"stop": REASON, "grace": S}` stops the node now, for that reason,
        with that grace (the submitter's teardown: one message over the open channel, no remote command to start);
        EOF (the connection or the submitter died) stops it too."""
        def run() -> None:
            # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader makes the interpreter
            # abort at exit ("_enter_buffered_busy").
            buf = b""
            try:
                while data := os.read(0, 4096):
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        if isinstance(msg, dict) and msg.get("stop"):
                            if isinstance(msg.get("grace"), (int, float)):
                                self.grace = float(msg["grace"])
                            self.stop(str(msg["stop"]))
                    buf = buf[-65536:]
            except OSError:
                pass
            self.stop("controlling connection closed (stdin EOF)")
        threading.Thread(target=run, daemon=True).start()

    def watch_parent(self, ppid: int) -> None:
        def run() -> None:
            while alive(ppid) and os.getppid() == ppid:
                time.sleep(0.2)
            self.stop(f"parent process {ppid} is gone")
        threading.Thread(target=run, daemon=True).start()

    def forward_heartbeats(self, interval: float = 0.5) -> None:
        """Print this node's new heartbeat lines as `ORCHESTRATE_HB {json}` (for backends without a shared
        filesystem: the submit host reads them from the agent's output stream)."""
        from orchestrator.node.heartbeat import HB_PREFIX
        tail = self.hb_tail(set(self.plan.node(self.rank).ranks))

        def run() -> None:
            while True:
                done = self.launch_done.is_set()
                write_lines(1, [HB_PREFIX + json.dumps(rec, sort_keys=True) for rec in tail.read()])
                if done:
                    return
                self.launch_done.wait(interval)  # woken at once when the launch ends: no exit latency
        self._hb_thread = threading.Thread(target=run, daemon=True)
        self._hb_thread.start()

    def monitor(self) -> None:
        """Health monitoring inside the allocation (SLURM: the submitting terminal may be gone), judged per node from
        its own ranks' heartbeats (orchestrator.node.hangwatch: what a poll reads, and when a node names a hang). On a
        hang it keeps the stacks of ITS ranks (the stopped ones first) and stops its launch with exit code 124;
        `srun --kill-on-bad-exit` then ends every node."""
        from orchestrator.node.hangwatch import HangWatch
        from orchestrator.node.proctools import state
        health = self.plan.health
        watch = HangWatch(self.rd, self.plan, self.rank, started=time.time())
        every = float(health.poll_interval)

        def run() -> None:
            kept = False
            while self.proc is not None and self.proc.poll() is None and not self.stopping.is_set():
                now = time.time()
                stalls = watch.poll(now)
                if stalls:
                    mine = marked_ranks(self.token)
                    stopped = {g: pid for g, pid in mine.items() if state(pid) == "T"}
                    if health.stack_dumps and mine and not kept:  # this node's evidence, once, as its ranks stall
                        from orchestrator.node.ops import keep_stacks
                        keep_stacks(self.rd, mine, set(stopped))
                        kept = True
                    text = watch.verdict(stalls, stopped, now, every)
                    if text is not None:
                        if kept:  # the one analysis over every node's evidence (shared run dir), as the supervisor's
                            from orchestrator.node.hangevidence import diagnose_run
                            diag = diagnose_run(self.rd, self.plan.world_size, wait_s=DIAGNOSE_WAIT_S,
                                                since=watch.started)
                            if diag is not None and diag.culprits:
                                node = diag.culprits[0] // max(1, self.plan.procs_per_node)
                                text = diag.root_cause(getattr(self.rd.agent(node), "host", ""))
                        self.hang = text
                        self.stop("hang: " + text)
                        return
                time.sleep(every)
        threading.Thread(target=run, daemon=True).start()

    def wait(self) -> int:
        assert self.proc is not None
        while True:
            try:
                rc = self.proc.wait()
                break
            except InterruptedError:
                continue
        self.launch_done.set()
        # Nothing of the job may outlive the launch: as its subreaper, no child left proves it (no scan); else
        # stragglers of the group, every marked process and the launch's orphans get TERM, then KILL.
        sweep_launch(self.proc.pid, self.token, min(self.grace, 2.0), self.subreaper)
        self.close_relay()  # the ranks' last lines, before anything the agent says about the end
        cp = self.plan.container
        if cp is not None and cp.runtime in ("podman", "docker"):  # its monitor removes it (--rm); if not, we do
            from orchestrator.node.containers import remove
            why = remove(cp.runtime, self.plan.job_id, self.rank)
            if why:
                os.write(2, f"orchestrate node agent: could not remove container of node {self.rank}: {why}\n".encode())
        hb = getattr(self, "_hb_thread", None)
        if hb is not None:
            hb.join(timeout=2)
        self.rank_death = self.container_killed(rc) or self.rank_death
        sig = -rc if rc < 0 else None
        code = 128 + sig if sig else rc
        hang = getattr(self, "hang", "")
        # Our own stop after a hang makes the ranks save as if preempted: that is still a failed (hung) run.
        # A node whose ranks saved and stopped on a preemption signal (SLURM's USR2) is preempted; one that WE stopped
        # (teardown, cancel, hang, a dead rank) is not, even if its ranks saved on the way out.
        preempted = code != 0 and not hang and not self.stop_reason and self.ranks_preempted()
        if hang:
            code = 124
        elif self.gpu_fault:
            from orchestrator.node.gpuwatch import EXIT_CODE as GPU_FAULT
            code = GPU_FAULT
        elif self.preflight_error:
            from orchestrator.node.preflight import EXIT_CODE
            code = EXIT_CODE
        elif self.rank_death is not None:
            code = self.rank_death.exit_code
        self.record_exit(ExitRecord(
            returncode=0 if preempted else code, time=time.time(), signal=sig, launch_returncode=code,
            stop_reason="" if self.preflight_error or self.gpu_fault else self.stop_reason,  # the node's own failure
            preempted=preempted, hang=hang or None, rank_death=self.rank_death.describe() if self.rank_death else None,
            host=socket.gethostname(), gpu_fault=self.gpu_fault or None))
        # A node whose ranks all saved a checkpoint on a preemption signal and stopped has done its job:
        # exit 0, so `srun --kill-on-bad-exit` does not kill other nodes still saving.
        return 0 if preempted else code

    def container_runtime(self) -> str:
        return self.plan.container.runtime if self.plan.container is not None else ""

    def container_killed(self, rc: int):
        """The node's podman/docker container killed from outside (`podman kill`): its `podman run` (the launch) ended
        by itself with 128+N while a rank's own status was unknown, or before any rank was seen to die. The rank's
        death with that signal, naming the container; else None."""
        death = self.rank_death
        if self.container_runtime() not in CONTAINER_DAEMONS or not 128 < rc < 128 + 65:
            return None
        if death is None and (self.stop_reason or self.stopping.is_set()):
            return None  # (we stopped it: its code is our own signal's)
        if death is not None and death.status is not None:
            return None
        import dataclasses
        from orchestrator.core.container import container_name
        from orchestrator.node.rankwatch import RankDeath
        if death is None:
            rank = min(self.plan.node(self.rank).ranks)
            death = RankDeath(rank, (self.watch.pids.get(rank, 0) if self.watch is not None else 0), None, None)
        return dataclasses.replace(death, status=-(rc - 128), container=container_name(self.plan.job_id, self.rank))

    def ranks_preempted(self) -> bool:
        """True when every rank of this node's last heartbeat says it stopped after a preemption save."""
        from orchestrator.node.rankwatch import last_event
        ranks = self.plan.node(self.rank).ranks
        return bool(ranks) and all(last_event(self.rd.heartbeats, r) == "preempted" for r in ranks)

    def hb_tail(self, ranks: set[int] | None):
        """A reader of this attempt's heartbeats: it starts at the files' current ends, so a restarted job's health
        starts from its own records (the previous attempt's steps are not this attempt's progress)."""
        from orchestrator.node.heartbeat import HeartbeatTail
        return HeartbeatTail(self.rd.heartbeats, ranks, from_end=True)


def write_lines(fd: int, lines: list[str], most: int = select.PIPE_BUF) -> None:
    """`lines` on `fd` in as few writes as fit in `most` bytes each (a pipe's atomic write: the ranks' relayed output on
    the same stdout is never cut into one), i.e. one SSH packet for a cycle's heartbeats, not one per record. Each
    write starts with a newline, so every line is one of its own even after a rank's unfinished line (tqdm)."""
    chunk = b""
    for line in lines:
        data = line.encode() + b"\n"
        if chunk and len(chunk) + len(data) > most:
            os.write(fd, chunk)
            chunk = b""
        chunk += (b"\n" if not chunk else b"") + data
    if chunk:
        os.write(fd, chunk)


def _child_setup() -> None:
    """In the launch process before exec: ignore USR2 (see start) and get SIGTERM if the agent dies (Linux
    PR_SET_PDEATHSIG), so an agent killed with SIGKILL still takes its launch down; torchrun then stops its
    ranks."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def take_lease(request: dict):
    """Take this node's lease (core.leases.lease_request's JSON) at once: (Held, None) — keep it for the life of this
    process — or (None, the busy lock with its holder)."""
    import getpass
    from orchestrator.core.leases import Lock, holder
    from orchestrator.node.lease import take
    try:
        me = f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):  # no passwd entry for the uid
        me = f"uid {os.getuid()}@{socket.gethostname()}"
    who = holder(str(request.get("job", "")), str(request.get("submitter") or me), os.getpid(), time.time(), "")
    return take([Lock.from_list(x) for x in request["locks"]], who, str(request["host"]))


PROBE_WORDS = ("release", "retry")  # a probing agent's control lines: {"release": true}, {"retry": true}


def read_secrets_line(words: bool = False) -> "dict[str, str] | str | None":
    """One JSON line from fd 0, read byte-wise so nothing after it is swallowed by a buffer; None on EOF before
    a complete line (with --probe: the submitter called the start off). `words`: a control line of a probing agent
    (`{"release": true}` or `{"retry": true}`, PROBE_WORDS; a bool value, so never a secrets line) is returned as
    its word."""
    buf = bytearray()
    while not buf.endswith(b"\n"):
        b = os.read(0, 1)
        if not b:
            return None
        buf += b
    line = bytes(buf)
    if not line.strip():
        return {}
    data = json.loads(line)
    if words and isinstance(data, dict) and len(data) == 1 and next(iter(data)) in PROBE_WORDS \
            and next(iter(data.values())) is True:
        return next(iter(data))
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise AgentError("--secrets-stdin expects one JSON object of string values")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--node-rank", type=int, default=None)
    ap.add_argument("--main-ip", default=None)
    ap.add_argument("--watch-stdin", action="store_true", help="tear the job down when stdin hits EOF")
    ap.add_argument("--secrets-stdin", action="store_true", help="read one JSON line of secret env from stdin")
    ap.add_argument("--watch-parent", action="store_true", help="tear the job down when the process that started "
                    "the agent dies")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds between TERM and KILL")
    ap.add_argument("--kill", action="store_true", help="kill every process of this node's launch (recorded in "
                    "agent.json), wherever it is in the process tree, and exit")
    ap.add_argument("--monitor", action=argparse.BooleanOptionalAction, default=None,
                    help="watch the heartbeats in the run dir and stop this node on a hang (default: on for SLURM)")
    ap.add_argument("--diagnose", action="store_true", help="print each rank's pid and process state and keep "
                    "py-spy stacks in RUN_DIR/stacks/ (hang diagnosis), then exit")
    ap.add_argument("--status", action="store_true", help="print one JSON line per node: agent alive, exit record")
    ap.add_argument("--forward-heartbeats", action="store_true",
                    help="print the ranks' heartbeats on stdout as ORCHESTRATE_HB lines")
    ap.add_argument(EMULATE_FLAG, metavar="SPEC", default=None,
                    help=f"benchmarks and tests only: as {EMULATE_VAR}=SPEC (orchestrator.node.emulate)")
    ap.add_argument("--probe", metavar="JSON", default=None,
                    help='pre-flight first ({"workdir", "port", "check"}, see orchestrator.node.probe): print '
                         "the result, then start only when a line arrives on stdin (EOF: exit, nothing started)")
    args = ap.parse_args(argv)
    # --emulate / ORCHESTRATE_EMULATE, parsed once: the one value says whether this node is emulated and what it
    # runs; a bad spec is refused with the node's other checks, before anything starts
    try:
        emulation, bad_emulation = Emulation.of(args.emulate or os.environ.get(EMULATE_VAR)), ""
    except ValueError as e:
        emulation, bad_emulation = None, str(e)
    parent = os.getppid()  # before anything can make this process an orphan
    if args.node_rank is not None and not (args.kill or args.diagnose or args.status):
        RunDir(Path(args.run_dir).expanduser()).forget_attempt(args.node_rank)  # (before its pre-flight can be killed)
    os.umask(0o077)  # everything the agent and its launch create in the run dir is owner-only
    lease = None  # the host's / GPUs' lease (core.leases): held by this process until it ends
    go: dict[str, str] | None = None  # the probe's go line (its secrets), read while it waited for it
    if args.probe is not None:
        from orchestrator.core.leases import EXIT_BUSY
        from orchestrator.node.probe import PROBE_MARK, probe_spec
        spec = json.loads(args.probe)
        while True:
            busy = None
            if spec.get("lease") and lease is None:
                lease, busy = take_lease(spec["lease"])
            # the lease first: a host that another job leases has its main port in use by that job, which is no
            # problem of this host (it waits, QUEUED): the port is checked once this job holds the lease
            res = probe_spec(dict(spec, port=0) if busy else spec)
            # (a main port open once this job holds the lease is not its last holder's: a holder's lease lives until
            # the last process it named is gone, node.lease.outlived; it is refused as on any host)
            if spec.get("lease"):
                res["busy"] = busy
            print(PROBE_MARK + json.dumps(res), flush=True)
            if res["problems"]:
                return 2
            # The submitter's word: the go (its secrets), or, while the job is QUEUED (this host or another one
            # leased by another job), {"release": true} (hold nothing while waiting) and later {"retry": true} (take
            # the lease and answer again), over this same connection: no new session per look.
            try:
                while (word := read_secrets_line(words=True)) == "release":
                    if lease is not None:
                        lease.release()
                        lease = None
            except (AgentError, ValueError) as e:
                print(f"orchestrate node agent: {e}", file=sys.stderr)
                return 2
            if word == "retry":
                continue
            if word is None:  # EOF: the start was called off (another host failed or the job is not waiting)
                return EXIT_BUSY if lease is None and res.get("busy") else 0
            assert isinstance(word, dict)
            go = word
            break
    run_dir = Path(args.run_dir).expanduser().resolve()
    if args.kill:
        from orchestrator.node.ops import kill_node
        return kill_node(run_dir, args.node_rank, args.grace)
    if args.diagnose:
        from orchestrator.node.ops import diagnose_node
        return diagnose_node(run_dir, args.node_rank)
    if args.status:
        from orchestrator.node.ops import node_status
        for row in node_status(run_dir, args.node_rank):
            print(json.dumps(row, sort_keys=True), flush=True)
        return 0
    try:
        line = go if go is not None else read_secrets_line() if args.secrets_stdin else None
        secrets = line if isinstance(line, dict) else {}  # (EOF before a line: none)
        planned = RunDir(run_dir).read_plan()
        plan = bind_port(planned, dict(os.environ))
        rank = bind_rank(args.node_rank, dict(os.environ), plan.nodes)
        if args.node_rank is None:  # (a rank from SLURM's environment: known only now)
            RunDir(run_dir).forget_attempt(rank)
        main_ip = bind_main_ip(args.main_ip, plan.main_host, dict(os.environ))
    except (AgentError, OSError, ValueError, KeyError) as e:
        print(f"orchestrate node agent: {e}", file=sys.stderr)
        return 2
    agent = Agent(run_dir, plan, rank, main_ip, grace=args.grace, rendered=plan is planned, emulation=emulation)
    # Its launch's orphans become its children (proctools.sweep_launch). Not with a container: its runtime's monitor
    # (podman's conmon) would become one, and the container's end is its runtime's (Agent.wait removes it).
    agent.subreaper = plan.container is None and become_subreaper()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: agent.forward(s))
    # network, GPUs (docs/gpus.md), the GPUs' health and the container (SLURM: nothing checked this node before)
    if args.probe is None:
        from orchestrator.core.leases import EXIT_BUSY, busy_text, lease_request
        request = lease_request(plan, rank)
        if request is not None:
            lease, busy = take_lease(request)
            if lease is None:
                return agent.refuse(busy_text(busy or {}), EXIT_BUSY, "LeaseBusy")
    agent.lease = lease
    problem = agent.node_checks() or agent.gpu_health_check() or agent.container_check() or bad_emulation
    if problem:
        return agent.refuse(problem)
    try:
        started = agent.start(secrets)
    except OSError as e:  # its run dir cannot be written (a full disk): nothing started, said in one line
        return agent.refuse(f"node {rank} ({socket.gethostname()}) cannot write its run dir: {write_error(e)}", 1,
                            "RunDirError")
    if not started:
        print(f"orchestrate node agent: {agent.stop_reason}; nothing started", file=sys.stderr)
        return 143
    # Emulated ranks (orchestrator.node.emulate): one process, no rank of its own to watch (RankWatch would scan /proc
    # for ranks that never come) and no rendezvous port to reach; its death is the launch's, which wait() sees.
    emulated = agent.emulated
    if not emulated:
        agent.watch_ranks()
    if args.watch_stdin:
        agent.watch_stdin()
    if args.watch_parent:
        agent.watch_parent(parent)
    if args.forward_heartbeats:
        agent.forward_heartbeats()
    if args.monitor or (args.monitor is None and plan.cluster_kind == "slurm"):
        agent.monitor()
    if not emulated:
        agent.watch_main_reachable()
        agent.watch_gpus()
    code = agent.wait()
    if lease is not None:
        lease.release()  # (the exit would too; said here so the lease visibly lives as long as the job)
    return code


if __name__ == "__main__":
    sys.exit(main())

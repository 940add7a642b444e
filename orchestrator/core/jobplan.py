"""The plan types: `LaunchPlan` and `NodePlan`, frozen and JSON round-tripping.

A LaunchPlan is the unit of dry run: `orchestrate render` prints it, `submit` stores it as
RUN_DIR/plan.json and every node agent reads its own NodePlan from there. Nothing here does I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.core.container import ContainerPlan
from orchestrator.core.health import HealthSpec

PLAN_VERSION = 1

# Placeholders that the node agent replaces with facts only the node knows (SLURM allocations).
LATE_MAIN_IP = "${main_process_ip}"
# Paths of the run dir in a plan start with this; each node binds it to where its run dir is (node.rundir).
RUN_DIR_VAR = "${RUN_DIR}"
# `network_interface: auto`: the rank env's GLOO/NCCL_SOCKET_IFNAME until the node agent binds it to the interface
# that routes to the main node (orchestrator.node.netcheck).
LATE_IFNAME = "${network_interface}"
# A job's own rendezvous port when launch.port is not given and other jobs may share its main host (`job_port`):
# under Linux's ephemeral range (32768-) from the default 29500.
JOB_PORT_OFFSET, JOB_PORT_SPREAD = 1001, 1500


def job_port(base: int, job: str) -> int:
    """`base` + JOB_PORT_OFFSET + the job's number % JOB_PORT_SPREAD: the same for every node of the job and again on
    its restarts and requeues, different for jobs that meet on one host. The number: a SLURM job id as it is, any
    other job id by its sha256 (a stable hash, not Python's per-process one). Used where two jobs can share the main
    host: SLURM jobs (the node agent binds it from SLURM_JOB_ID) and SSH jobs of a GPU subset of their main host (the
    planner), whose other GPUs another job may lease (orchestrator.core.leases)."""
    import hashlib
    number = int(job) if job.isdigit() else int.from_bytes(hashlib.sha256(job.encode()).digest()[:8], "big")
    return int(base) + JOB_PORT_OFFSET + number % JOB_PORT_SPREAD


@dataclass(frozen=True)
class NodePlan:
    """What one node runs. `host` is empty when the scheduler picks the host (SLURM)."""

    node_rank: int
    host: str
    ranks: tuple[int, ...]
    accelerate_config: dict[str, Any]
    command: tuple[str, ...]  # argv the node agent executes (accelerate launch ...)
    env: dict[str, str]  # non-secret environment for the ranks

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        d["command"] = list(self.command)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodePlan":
        return cls(node_rank=int(d["node_rank"]), host=str(d["host"]), ranks=tuple(d["ranks"]),
                   accelerate_config=dict(d["accelerate_config"]), command=tuple(d["command"]),
                   env=dict(d["env"]))


@dataclass(frozen=True)
class LaunchPlan:
    """The whole job, resolved: sizes, batch arithmetic, and every node's config and command."""

    job_id: str
    recipe: str  # a built-in recipe: sft | dpo | cp; own code: its run kind, script | module | trl
    recipe_name: str  # file stem, for humans
    cluster_kind: str  # local | ssh | slurm
    cluster_name: str
    accelerator: str  # cpu | gpu
    profile: str
    distributed_type: str
    nodes: int
    procs_per_node: int
    world_size: int
    parallelism: dict[str, int]
    data_parallel_size: int
    per_device_batch: int | None  # None: own code whose args carry no batch fields (its code decides)
    grad_accum: int | None
    effective_batch: int | None
    max_length: int | None
    tokens_per_step: int | None  # exact when packing, else an upper bound
    tokens_per_step_exact: bool
    main_host: str  # LATE_MAIN_IP when the scheduler decides
    port: int
    run_dir: str  # where the submitter writes the run dir (a node may see it elsewhere: paths use RUN_DIR_VAR)
    output_dir: str
    python: str
    secret_env: tuple[str, ...]  # names passed through from the submit environment, never values
    node_plans: tuple[NodePlan, ...]
    warnings: tuple[str, ...] = ()
    health: HealthSpec = field(default_factory=HealthSpec)
    version: int = PLAN_VERSION
    # What every rank runs (the entry after `accelerate launch --config_file ...` in each node's command):
    run_kind: str = "recipe"  # recipe (built-in: -m recipes.run) | script | module | trl
    run_target: str = ""  # script: its absolute path; module: its name; trl: the subcommand (sft, grpo, ...)
    run_paths: tuple[str, ...] = ()  # own code: the absolute local paths its command names (script, path-like args)
    # GPUs (docs/gpus.md): what each node gives the job (the SLURM allocation, the hosts' or this machine's GPUs, or
    # the `gpus:` subset); None: a CPU job, or not known when planning (the SSH pre-flight asks the hosts).
    gpus_per_node: int | None = None
    gpu_ids: tuple[int, ...] = ()  # the `gpus:` subset of every node (indices into what the node may use); (): all
    allow_idle_gpus: bool = False
    network_interface: str | None = None  # the interface every node must have, "auto" (bound per node), None: any
    env_passthrough: tuple[str, ...] = ()  # names of the submitter's variables in the env (launch.env_passthrough)
    # SSH hosts without a shared filesystem (docs/staging.md): the ranks' working directory (RUN_DIR_VAR-relative;
    # "": the agent's own) and the content hash of the node package the hosts get (""; they import their own)
    rank_cwd: str = ""
    node_package: str = ""
    # The container every node's launcher runs in (docs/containers.md); None: the hosts' own python. `package_root`:
    # where the submit host's node package is (holding orchestrator/ and recipes/; a container mounts those two).
    container: ContainerPlan | None = None
    package_root: str = ""
    # Who submitted it (user@host, filled by the api): a lease file names it (core.leases.holder)
    submitter: str = ""
    # SLURM without launch.port: the node agents take the rendezvous port from the allocation (node.agent.bind_port), so
    # jobs the scheduler puts on the same nodes do not meet on one port; `port` is then the base
    port_per_job: bool = False
    # SSH: the cluster's hosts past the first `nodes`, in order: they run nothing and wait as spares (docs/ssh.md)
    spare_hosts: tuple[str, ...] = ()

    def node(self, rank: int) -> NodePlan:
        return self.node_plans[rank]

    def needed(self) -> tuple[str, ...]:
        """What the ranks' interpreter must import (jobplan.needed_packages)."""
        return needed_packages(self.run_kind, self.distributed_type == "DEEPSPEED")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["node_plans"] = [n.to_dict() for n in self.node_plans]
        d["secret_env"] = list(self.secret_env)
        d["warnings"] = list(self.warnings)
        d["run_paths"] = list(self.run_paths)
        d["gpu_ids"] = list(self.gpu_ids)
        d["env_passthrough"] = list(self.env_passthrough)
        d["spare_hosts"] = list(self.spare_hosts)
        d["container"] = self.container.to_dict() if self.container is not None else None
        for name in _UNSET_LEFT_OUT:  # fields added after version 1: written when they say something (a built-in
            if d[name] == _DEFAULTS[name]:  # recipe's plan.json keeps its bytes)
                del d[name]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LaunchPlan":
        d = dict(d)
        d["node_plans"] = tuple(NodePlan.from_dict(n) for n in d["node_plans"])
        d["secret_env"] = tuple(d.get("secret_env", ()))
        d["warnings"] = tuple(d.get("warnings", ()))
        d["run_paths"] = tuple(d.get("run_paths", ()))
        d["gpu_ids"] = tuple(d.get("gpu_ids", ()))
        d["env_passthrough"] = tuple(d.get("env_passthrough", ()))
        d["spare_hosts"] = tuple(d.get("spare_hosts", ()))
        d["container"] = ContainerPlan.from_dict(d["container"]) if d.get("container") else None
        d["parallelism"] = dict(d["parallelism"])
        d["health"] = HealthSpec.from_dict(d.get("health"))
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "LaunchPlan":
        return cls.from_dict(json.loads(text))


_UNSET_LEFT_OUT = ("run_kind", "run_target", "run_paths", "gpus_per_node", "gpu_ids", "allow_idle_gpus",
                   "network_interface", "env_passthrough", "rank_cwd", "node_package", "container", "package_root",
                   "submitter", "port_per_job", "spare_hosts")
_DEFAULTS: dict[str, Any] = {"run_kind": "recipe", "run_target": "", "run_paths": [], "gpus_per_node": None,
                             "gpu_ids": [], "allow_idle_gpus": False, "network_interface": None, "env_passthrough": [],
                             "rank_cwd": "", "node_package": "", "container": None,
                             "package_root": "", "submitter": "", "port_per_job": False, "spare_hosts": []}
def needed_packages(run_kind: str, deepspeed: bool = False) -> tuple[str, ...]:
    """The Python packages the ranks' interpreter must have (a host's, or the container image's): torch and
    accelerate always; transformers and trl for a built-in recipe or a TRL subcommand; deepspeed for its profiles."""
    out = ("torch", "accelerate") + (("transformers", "trl") if run_kind in ("recipe", "trl") else ())
    return out + (("deepspeed",) if deepspeed else ())


# What the node agent sets for the ranks besides the plan's env (orchestrator.node.agent.Agent.environment): a
# container gets these names passed in (with the plan's env, the container's env and the secrets).
AGENT_ENV = ("ORCHESTRATE_RUN_DIR", "ORCHESTRATE_JOB_ID", "ORCHESTRATE_NODE_RANK", "ORCHESTRATE_ACCELERATOR",
             "ORCHESTRATE_HEARTBEAT_DIR", "PYTHONUNBUFFERED", "PYTHONPATH")

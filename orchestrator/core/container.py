"""Containers: the ONE builder of a node's container command, for every backend and runtime. Pure, and a leaf that
the node agent imports (standard library only).

A job's `container:` block (core.spec.ContainerSpec, the cluster's merged under the job's) becomes a `ContainerPlan`
in the LaunchPlan. Where the node agent runs:

- agent-side runtimes (podman, docker, apptainer, enroot): the node agent stays OUTSIDE the container (standard
  library, shipped as without a container) and starts the launcher (`python -m accelerate.commands.launch ...`)
  inside it through `node_argv`. podman/docker containers share the host's network, IPC and PID namespaces
  (`--network host --ipc host --pid host`), so the agent sees every rank as a host process: the rank watch (pidfds),
  the job-token teardown, py-spy stacks and signals work as without a container; the container is named
  `container_name(job, node)` and labelled `orchestrate.job=<job>`, so a teardown or `cancel` on any host finds it.
  apptainer and enroot containers are plain child processes of the agent (no daemon, host PID namespace).
- pyxis (SLURM only): the flags go on the task's `srun` step (`srun_flags`); the node agent then runs inside the
  container, from the node package mounted at the same path (no agent-side runtime).

Secrets never reach a command line: podman/docker get `--env NAME` (the value comes from the environment the agent
gives the runtime), enroot `--env NAME` likewise; apptainer and pyxis pass the host environment through.
Paths: the run dir, the node package and the ranks' working directory are mounted at the same path inside (nothing
in the plan changes its paths); `mounts` adds the user's own (`HOST:CONTAINER[:ro|rw]`, HOST absolute or `~/...`,
expanded on each node).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

TOKEN_VAR = "ORCHESTRATE_JOB_TOKEN"  # = orchestrator.node.proctools.TOKEN_VAR (the marker of a launch's processes)
RUNTIMES = ("pyxis", "enroot", "apptainer", "podman", "docker")
DAEMON_RUNTIMES = ("podman", "docker")  # containers outlive their client: named, labelled, removed by name
AGENT_SIDE = ("enroot", "apptainer", "podman", "docker")  # the node agent starts the launcher in the container
TOKEN_ON_LINE = ("enroot", "podman", "docker")  # the launch's marker goes on the line (apptainer inherits the env)
LABEL = "orchestrate.job"
# The order `runtime: auto` takes what a machine has (on SLURM: pyxis first when srun knows --container-image).
AUTO_ORDER = {"slurm": ("pyxis", "apptainer", "enroot", "podman", "docker"),
              "ssh": ("podman", "docker", "apptainer", "enroot"),
              "local": ("podman", "docker", "apptainer", "enroot")}
# Placeholders render shows where the node binds the value (the node package's place differs per host when staged).
PACKAGE_VAR = "${NODE_PACKAGE}"
# Inside every container the node package (orchestrator and recipes, nothing else of the host's python) is mounted
# here, read-only: the image's own torch & co. stay the ones that run.
PACKAGE_DIR = "/opt/orchestrate"
PACKAGES = ("orchestrator", "recipes")
HOOKS_DIR = f"{PACKAGE_DIR}/orchestrator/node/hooks"
PYTHONPATH = f"{HOOKS_DIR}:{PACKAGE_DIR}"  # the ranks' zero-code hooks first, then the package


@dataclass(frozen=True)
class Mount:
    host: str  # absolute, or ~/... expanded on the node
    path: str  # absolute, inside the container
    mode: str = "rw"  # ro | rw

    def text(self) -> str:
        return f"{self.host}:{self.path}:{self.mode}"


def parse_mount(text: Any) -> tuple[Mount | None, str | None]:
    """`HOST:CONTAINER[:ro|rw]` or `HOST` (the same path inside) -> (Mount, None) or (None, why)."""
    if not isinstance(text, str) or not text.strip():
        return None, f"must be HOST:CONTAINER[:ro|rw], got {text!r}"
    parts = text.split(":")
    if len(parts) > 3 or any(not p for p in parts):
        return None, f"must be HOST:CONTAINER[:ro|rw], got {text!r}"
    host = parts[0]
    path = parts[1] if len(parts) > 1 else host
    mode = parts[2] if len(parts) > 2 else "rw"
    if mode not in ("ro", "rw"):
        return None, f"mode must be ro or rw, got {mode!r} in {text!r}"
    if not (host.startswith("/") or host == "~" or host.startswith("~/")):
        return None, f"host path must be absolute (or ~/...), got {host!r} in {text!r}"
    if not path.startswith("/"):
        return None, f"container path must be absolute, got {path!r} in {text!r}"
    if "," in text:
        return None, f"a path with a comma cannot be mounted by every runtime: {text!r}"
    return Mount(posixpath.normpath(host) if host.startswith("/") else host, posixpath.normpath(path), mode), None


@dataclass(frozen=True)
class ContainerPlan:
    """The container of every node of a job, resolved (runtime chosen, mounts parsed). JSON round-trips."""

    runtime: str
    image: str
    mounts: tuple[Mount, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # non-secret values set inside (container.env)
    workdir: str = ""  # the ranks' working directory inside ("": the one they get without a container)
    python: str = "python3"  # the image's interpreter: what runs `-m accelerate.commands.launch`
    options: tuple[str, ...] = ()  # extra runtime flags (container.options), verbatim
    gpus: bool = False  # pass the node's GPUs (podman CDI / docker --gpus / apptainer --nv)

    @property
    def agent_side(self) -> bool:
        return self.runtime in AGENT_SIDE

    def to_dict(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "image": self.image, "mounts": [m.text() for m in self.mounts],
                "env": dict(sorted(self.env.items())), "workdir": self.workdir, "python": self.python,
                "options": list(self.options), "gpus": self.gpus}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ContainerPlan":
        mounts = []
        for text in d.get("mounts") or ():
            m, why = parse_mount(text)
            if m is None:
                raise ValueError(f"container mount: {why}")
            mounts.append(m)
        return cls(runtime=str(d["runtime"]), image=str(d["image"]), mounts=tuple(mounts),
                   env={str(k): str(v) for k, v in (d.get("env") or {}).items()}, workdir=str(d.get("workdir") or ""),
                   python=str(d.get("python") or "python3"), options=tuple(d.get("options") or ()),
                   gpus=bool(d.get("gpus")))


def container_name(job_id: str, node_rank: int) -> str:
    """The name of node `node_rank`'s container (podman/docker names: [a-zA-Z0-9][a-zA-Z0-9_.-]*)."""
    safe = "".join(c if c.isalnum() or c in "_.-" else "-" for c in job_id)
    return f"orch-{safe}-n{node_rank}"


def job_mounts(cp: ContainerPlan, *, run_dir: str, package: str, cwd: str, roots: tuple[str, ...] = ()) -> list[Mount]:
    """What every node mounts: `roots` (a staged host's work dir: run dir, cache and outputs under one), the run dir
    and the ranks' working directory, each at the same path inside (so the plan's paths hold in the container) unless
    one already covers it; the node package's two packages under PACKAGE_DIR (read-only); then the user's mounts."""
    out: list[Mount] = []
    for path in (*roots, run_dir, cwd):
        if path and not any(covers(m.host, path) for m in out):
            out.append(Mount(path, path, "rw"))
    if package:
        out += [Mount(f"{package.rstrip('/')}/{name}", f"{PACKAGE_DIR}/{name}", "ro") for name in PACKAGES]
    return out + list(cp.mounts)


def covers(mount_host: str, path: str) -> bool:
    """`path` lies at or below `mount_host` (both absolute, normalised)."""
    mount_host = mount_host.rstrip("/") or "/"
    return path == mount_host or path.startswith(mount_host if mount_host == "/" else mount_host + "/")


def visible(mounts: list[Mount] | tuple[Mount, ...], host_path: str) -> bool:
    """`host_path` is seen at the same path inside the container (what a path written in the plan needs): the mount
    that decides what lies at that path inside (the deepest destination covering it) brings that very host path."""
    best = None
    for m in mounts:
        if covers(m.path, host_path) and (best is None or len(m.path) > len(best.path)):
            best = m
    return best is not None and best.host.startswith("/") and \
        best.host.rstrip("/") + host_path[len(best.path.rstrip("/")):] == host_path


def inside(mounts: list[Mount] | tuple[Mount, ...], host_path: str) -> str | None:
    """Where `host_path` is seen inside the container, or None when no mount covers it (the longest mount wins)."""
    best = None
    for m in mounts:
        if m.host.startswith("/") and covers(m.host, host_path) and (best is None or len(m.host) > len(best.host)):
            best = m
    if best is None:
        return None
    rest = host_path[len(best.host.rstrip("/")):]
    return best.path.rstrip("/") + rest if rest else best.path


def node_argv(cp: ContainerPlan, inner: list[str] | tuple[str, ...], *, job_id: str, node_rank: int, run_dir: str,
              package: str, cwd: str, env_names: list[str] | tuple[str, ...], token: str = "",
              roots: tuple[str, ...] = ()) -> list[str]:
    """The full command an agent-side runtime runs for node `node_rank`: `inner` (the launcher's argv, already bound
    to this node) inside the image. `env_names`: the variables the ranks get (values from the runtime's own
    environment, never on this line); `token`: the launch's marker (orchestrator.node.proctools.TOKEN_VAR, not a
    secret) set on the line itself, so that only the container's processes carry it (never the runtime's client or
    its monitor, which must outlive the ranks to remove the container); `cwd`: the ranks' working directory on the
    host (mounted, and where they start unless `workdir` says otherwise)."""
    mounts = job_mounts(cp, run_dir=run_dir, package=package, cwd=cwd, roots=roots)
    workdir = cp.workdir or (inside(mounts, cwd) if cwd else "") or ""
    names = sorted(set(env_names) | set(cp.env))
    if cp.runtime in DAEMON_RUNTIMES:
        argv = [cp.runtime, "run", "--rm", "--name", container_name(job_id, node_rank),
                "--label", f"{LABEL}={job_id}", "--label", f"orchestrate.node={node_rank}",
                "--network", "host", "--ipc", "host", "--pid", "host"]
        if cp.gpus:
            argv += ["--device", "nvidia.com/gpu=all"] if cp.runtime == "podman" else ["--gpus", "all"]
        for m in mounts:
            argv += ["-v", f"{m.host}:{m.path}:{m.mode}"]
        if workdir:
            argv += ["-w", workdir]
        for n in names:
            argv += ["--env", n]
        if token:
            argv += ["--env", f"{TOKEN_VAR}={token}"]
        return argv + list(cp.options) + [cp.image, *inner]
    if cp.runtime == "apptainer":
        argv = ["apptainer", "exec"] + (["--nv"] if cp.gpus else [])
        argv += ["--bind", ",".join(f"{m.host}:{m.path}:{m.mode}" for m in mounts)]
        if workdir:
            argv += ["--pwd", workdir]
        return argv + list(cp.options) + [cp.image, *inner]
    if cp.runtime == "enroot":
        argv = ["enroot", "start"]
        for m in mounts:
            argv += ["--mount", f"{m.host}:{m.path}:{'ro' if m.mode == 'ro' else 'rw'},x-create=dir"]
        for n in names:
            argv += ["--env", n]
        if token:
            argv += ["--env", f"{TOKEN_VAR}={token}"]
        argv += list(cp.options) + [cp.image]
        # enroot has no working-directory flag: start there through the image's own shell, by argv (no string built)
        return argv + (["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", workdir, *inner] if workdir
                       else list(inner))
    raise ValueError(f"runtime {cp.runtime!r} does not start on the node agent's side")


def container_argv_shown(cp: ContainerPlan, inner: list[str], *, job_id: str, node_rank: int, run_dir: str, cwd: str,
                         env_names: list[str]) -> list[str]:
    """`node_argv` as `render` shows it: the node package and the launch's marker as placeholders."""
    return node_argv(cp, inner, job_id=job_id, node_rank=node_rank, run_dir=run_dir, package=PACKAGE_VAR, cwd=cwd,
                     env_names=env_names, token="${JOB_TOKEN}" if cp.runtime in TOKEN_ON_LINE else "")


def srun_flags(cp: ContainerPlan, *, run_dir: str, package: str, cwd: str, env_names: list[str] | tuple[str, ...]
               ) -> list[str]:
    """pyxis: the flags of the task step that puts the node agent (and so the launcher and ranks) in the container
    (the agent then runs from PACKAGE_DIR: PYTHONPATH must be among `env_names`, set to PYTHONPATH by the script)."""
    mounts = job_mounts(cp, run_dir=run_dir, package=package, cwd=cwd)
    flags = [f"--container-image={cp.image}",
             "--container-mounts=" + ",".join(f"{m.host}:{m.path}:{m.mode}" for m in mounts),
             "--no-container-mount-home"]
    workdir = cp.workdir or (inside(mounts, cwd) if cwd else "") or ""
    if workdir:
        flags.append(f"--container-workdir={workdir}")
    names = sorted(set(env_names))  # (container.env is in the plan's env: the agent, inside, gives it to the ranks)
    if names:
        flags.append("--container-env=" + ",".join(names))
    return flags + list(cp.options)


def remove_argv(runtime: str, name: str, grace: float = 0.0) -> list[str] | None:
    """How to remove the container `name` (podman/docker), else None: stopped at once, or with `grace` > 0 given
    that long between TERM and KILL (a rank still saving a checkpoint on its stop signal finishes it), then removed.
    docker's `rm` has no grace: its `stop_argv` comes first."""
    if runtime not in DAEMON_RUNTIMES:
        return None
    return [runtime, "rm", "-f", "--time", f"{max(0, round(grace))}", "--ignore", name] if runtime == "podman" else \
        [runtime, "rm", "-f", name]


def stop_argv(runtime: str, name: str, grace: float) -> list[str] | None:
    """docker only (podman's `rm --time` does both): stop the container `name` with `grace` seconds before KILL."""
    return ["docker", "stop", "-t", f"{max(0, round(grace))}", name] if runtime == "docker" and grace > 0 else None


def list_argv(runtime: str, job_id: str) -> list[str] | None:
    """Every container (running or not) that carries the job's label: one name per line."""
    if runtime not in DAEMON_RUNTIMES:
        return None
    return [runtime, "ps", "-a", "--filter", f"label={LABEL}={job_id}", "--format", "{{.Names}}"]

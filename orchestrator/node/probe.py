"""The pre-flight checks a node agent runs on its host before anything starts (SSH backend).

`probe(workdir, port, check_file, ...)` -> {"python", "version", "workdir" (resolved), "problems": [...]}: accelerate
importable, the work dir creatable and writable, the main port free (main node only), the shared run dir
visible (shared_fs); and (docs/gpus.md) the network interface named by the cluster exists (`auto`: the one that
routes to the main node is found), NCCL_IB_HCA names InfiniBand devices of the host, and, for a GPU job, the host's
GPU inventory ("gpus": [{index, name, memory_mib, driver}], "visible": CUDA_VISIBLE_DEVICES or null) that the
submitter compares across hosts and with the plan. `probe_spec` reads the agent's `--probe` JSON.
The agent started with `--probe` prints the result as one `ORCHESTRATE_PROBE {json}` line,
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


def probe_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The probe as the agent's `--probe` JSON asks: {"workdir", "port", "check", "ifname", "main", "ib_hca",
    "gpus"}."""
    return probe(str(spec.get("workdir", ".")), int(spec.get("port", 0)), str(spec.get("check", "")),
                 ifname=spec.get("ifname") or None, main=spec.get("main") or None, ib_hca=spec.get("ib_hca") or None,
                 gpus=bool(spec.get("gpus")), container=spec.get("container") or None,
                 needed=tuple(spec.get("needed") or ()), gpu_health=spec.get("gpu_health"))


def probe(workdir: str, port: int = 0, check_file: str = "", *, ifname: str | None = None, main: str | None = None,
          ib_hca: str | None = None, gpus: bool = False, container: dict[str, Any] | None = None,
          needed: tuple[str, ...] = (), gpu_health: dict[str, Any] | None = None) -> dict[str, Any]:
    """`container`: the plan's container (core.container.ContainerPlan as a dict): the stack is checked in its image
    (orchestrator.node.containers.preflight, result under "container"), not in this python."""
    r: dict[str, Any] = {"python": sys.executable, "version": sys.version.split()[0], "problems": []}
    if container is not None:
        from orchestrator.core.container import ContainerPlan
        from orchestrator.node.containers import preflight
        r["container"] = preflight(ContainerPlan.from_dict(container), needed)
        r["problems"].extend(r["container"]["problems"])
    else:
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
        r["problems"].append(f"ssh.workdir {workdir} cannot be created or written: {e.strerror or e}")
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
    _network(r, ifname, main, ib_hca)
    if gpus:
        from orchestrator.node import gpus as inventory
        inv = inventory.inventory()
        r["gpus"], r["visible"] = inv["gpus"], inventory.visible()
        if inv["error"] and not inv["gpus"]:
            r["gpu_error"] = inv["error"]
        if gpu_health is not None and inv["gpus"]:  # judged by the submitter (orchestrator.core.gpuhealth)
            r["gpu_health"] = inventory.health(diag=bool(gpu_health.get("diag")))
    return r


def _network(r: dict[str, Any], ifname: str | None, main: str | None, ib_hca: str | None) -> None:
    from orchestrator.node import netcheck
    host = socket.gethostname()
    if ifname == "auto" and main:
        name, why = netcheck.route_interface(main)
        if name is None:
            r["problems"].append(f"network_interface auto: {why}")
        r["ifname"] = name
    elif ifname:
        problem = netcheck.check_interface(ifname, host)
        if problem:
            r["problems"].append(problem)
        r["ifname"] = ifname
    if ib_hca:
        problem = netcheck.check_ib_hca(ib_hca, host)
        if problem:
            r["problems"].append(problem)

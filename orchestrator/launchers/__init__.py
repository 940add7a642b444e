"""Backends that put a LaunchPlan onto machines: local, ssh (paramiko), slurm (submitit).

`get_launcher(kind)` imports only the backend asked for, so paramiko/submitit stay lazy.
"""

from __future__ import annotations


def get_launcher(kind: str, cluster):
    if kind == "local":
        from orchestrator.launchers.local import LocalLauncher
        return LocalLauncher(cluster)
    if kind == "ssh":
        from orchestrator.launchers.ssh.launcher import SSHLauncher
        return SSHLauncher(cluster)
    if kind == "slurm":
        from orchestrator.launchers.slurm.launcher import SlurmLauncher
        return SlurmLauncher(cluster)
    raise ValueError(f"unknown cluster kind {kind!r}")

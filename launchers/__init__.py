"""Backends that put a LaunchPlan onto machines: the one registry table. `launcher_for(cluster)` imports only the
backend asked for, so paramiko / submitit stay unimported until a job needs them."""

from __future__ import annotations

import importlib

BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("launchers.local", "LocalLauncher"),
    "ssh": ("launchers.ssh.launcher", "SSHLauncher"),
    "slurm": ("launchers.slurm.launcher", "SlurmLauncher"),
}


def launcher_for(cluster):
    try:
        module, name = BACKENDS[cluster.kind]
    except KeyError:
        raise ValueError(f"unknown cluster kind {cluster.kind!r}; one of {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module), name)(cluster)

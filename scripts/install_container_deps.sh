#!/usr/bin/env bash
# Install what the container tests need: Debian's podman and runc, and (as a site admin would) the machine-wide
# containers.conf that this kind of machine needs (../shared/TESTBED.md "Containers": runc + cgroupfs, because crun
# refuses the kernel's hybrid cgroups; lower default ulimits, because the defaults exceed the hard limits here).
# Idempotent: a second run only checks. Needs root (or sudo) for apt and /etc.
set -euo pipefail

bash "$(dirname "$0")/apt_install.sh" podman runc
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
conf=/etc/containers/containers.conf
mark="# orchestrate test machine (scripts/install_container_deps.sh)"
if [ ! -f "$conf" ]; then
    $SUDO mkdir -p /etc/containers
    $SUDO tee "$conf" >/dev/null <<CONF
$mark: this kernel's hybrid cgroups need runc + cgroupfs,
# and the default ulimits exceed the hard limits here.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
CONF
    echo "wrote $conf"
elif ! grep -qF "$mark" "$conf"; then
    echo "install_container_deps: $conf exists and is not ours: left as it is" >&2
fi
podman run --rm --help >/dev/null 2>&1 || { echo "install_container_deps: podman does not run" >&2; exit 1; }
echo "install_container_deps: done"

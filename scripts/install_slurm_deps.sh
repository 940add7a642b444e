#!/usr/bin/env bash
# Install what the local SLURM testbed (scripts/slurm_cluster.sh) needs, from Debian's packages.
# Idempotent: packages already installed are left alone, and apt is not touched at all then.
# No daemon is started here (there is no systemd; the cluster script starts them directly).
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server iproute2 util-linux)

if [ "$(id -u)" -ne 0 ]; then
    echo "install_slurm_deps.sh: must run as root (apt-get install)" >&2
    exit 1
fi

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_slurm_deps.sh: all present (${PKGS[*]})"
    exit 0
fi

echo "install_slurm_deps.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d: keep apt from trying to start daemons (no init system here anyway).
prc=/usr/sbin/policy-rc.d
made_prc=0
if [ ! -e "$prc" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$prc"; chmod +x "$prc"; made_prc=1
fi
trap '[ "$made_prc" = 1 ] && rm -f "$prc"' EXIT
if ! apt-get -o DPkg::Lock::Timeout=120 install -y --no-install-recommends "${missing[@]}" >/tmp/install_slurm_deps.log 2>&1; then
    apt-get -o DPkg::Lock::Timeout=120 update >>/tmp/install_slurm_deps.log 2>&1
    apt-get -o DPkg::Lock::Timeout=120 install -y --no-install-recommends "${missing[@]}" >>/tmp/install_slurm_deps.log 2>&1 || {
        echo "install_slurm_deps.sh: apt-get install failed, see /tmp/install_slurm_deps.log" >&2
        tail -20 /tmp/install_slurm_deps.log >&2
        exit 1
    }
fi
echo "install_slurm_deps.sh: done"

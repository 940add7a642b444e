#!/usr/bin/env bash
# Install what the SSH testbed needs (openssh-server, openssh-client, pdsh; nftables to cut a host off; tcpdump to
# capture the staging relay's traffic in tests/staging), skipping what is present.
# Idempotent: a second run does nothing but print "present". Needs root (or sudo) for apt.
set -euo pipefail

want=(openssh-server openssh-client pdsh nftables tcpdump)
missing=()
for pkg in "${want[@]}"; do
    if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        echo "present: $pkg"
    else
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
        echo "install_ssh_deps: need root to install: ${missing[*]}" >&2; exit 1; fi
fi

echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they are absent or older than a day.
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -n 1)" ]; then
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -q
fi
# --no-install-recommends keeps out xauth & co; policy-rc.d stops the package from starting sshd.
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
# Debian's package may have generated /etc/ssh host keys and tried to start the system sshd;
# the testbed never uses either (every test host has its own config and key).
$SUDO mkdir -p /run/sshd
echo "done"

#!/usr/bin/env bash
# Install what the SSH testbed needs (openssh-server, openssh-client, pdsh; nftables to cut a host off; tcpdump to
# capture the staging relay's traffic in tests/staging), skipping what is present.
# Idempotent: a second run does nothing but print "present". Needs root (or sudo) for apt.
set -euo pipefail

# --no-install-recommends (apt_install.sh) keeps out xauth & co; policy-rc.d stops the package from starting sshd.
bash "$(dirname "$0")/apt_install.sh" openssh-server openssh-client pdsh nftables tcpdump
# Debian's package may have generated /etc/ssh host keys and tried to start the system sshd;
# the testbed never uses either (every test host has its own config and key).
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
$SUDO mkdir -p /run/sshd
echo "done"

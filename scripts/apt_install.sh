#!/usr/bin/env bash
# Install the Debian packages named as arguments, skipping what is present (the install_*_deps.sh scripts' one way to
# do it). Idempotent: a second run does nothing but print "present". Needs root (or sudo) for apt.
# Usage: scripts/apt_install.sh PKG...
set -euo pipefail

want=("$@")
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
        echo "apt_install: need root to install: ${missing[*]}" >&2; exit 1; fi
fi

echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they are absent or older than a day.
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -n 1)" ]; then
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -q
fi
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
echo "done"

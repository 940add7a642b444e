#!/usr/bin/env bash
# Install what the dashboard's browser tests need (tests/web): Debian's chromium and chromium-driver (selenium drives
# them headless, offline), skipping what is present. Needs root (or sudo) for apt.
set -euo pipefail
exec bash "$(dirname "$0")/apt_install.sh" chromium chromium-driver

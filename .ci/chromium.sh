#!/usr/bin/env bash
# Install Debian's headless-capable `chromium` for the dashboard test (tests/hpo/test_dashboard.py), with apt-get,
# if it is missing. Never fails the caller: if it cannot be installed, it says why and exits 0, and the Chromium
# test skips printing the reason.
set -u
say() { echo "chromium.sh: $*"; }

if command -v chromium >/dev/null 2>&1; then
  say "already installed: $(chromium --version 2>/dev/null | head -n 1)"
  exit 0
fi
if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null 2>&1; then
  say "not root and no sudo: cannot apt-get install chromium; the Chromium test will skip"
  exit 0
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
say "installing Debian's chromium (apt-get)"
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; } \
    >/tmp/lds-chromium-apt.log 2>&1; then
  say "apt-get install chromium failed (see /tmp/lds-chromium-apt.log); the Chromium test will skip"
  exit 0
fi
say "installed: $(chromium --version 2>/dev/null | head -n 1)"
exit 0

#!/usr/bin/env bash
# The browser test's one system dependency: Debian's chromium at /usr/bin/chromium (driven by
# Python playwright; never `playwright install`). Installs it with apt when it is missing and we
# are root; otherwise says what to do. Safe to run again.
set -euo pipefail
CHROMIUM=${MPNB_CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup-browser: $CHROMIUM is missing; installing Debian's chromium with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
  if [ -x "$CHROMIUM" ]; then
    echo "setup-browser: installed $("$CHROMIUM" --version 2>/dev/null || echo chromium)"
    exit 0
  fi
  echo "setup-browser: apt-get ran but $CHROMIUM is still missing." >&2
else
  echo "setup-browser: $CHROMIUM is missing and this is not root with apt-get;" \
    "install it with: sudo apt-get install -y chromium (or set MPNB_CHROMIUM)." >&2
fi
# The browser test fails in CI (CI=true) without chromium and skips elsewhere; not fatal here.
exit 0

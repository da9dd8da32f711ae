#!/usr/bin/env bash
# Installs what tests/server/test_browser.py needs on a fresh Debian machine:
#   Debian's chromium + chromium-driver (apt) and the selenium Python bindings (PyPI, into the venv).
# Idempotent: skips whatever is already present. Exits non-zero if something cannot be installed;
# the test then skips with the reason.
set -euo pipefail

PYTHON="${PYTHON:-$(dirname "$0")/../../.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core
fi

if ! "$PYTHON" -c "import selenium" >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q "selenium>=4.20"
fi

chromium --version
chromedriver --version
"$PYTHON" -c "import selenium; print('selenium', selenium.__version__)"

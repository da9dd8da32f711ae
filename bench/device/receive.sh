#!/usr/bin/env bash
# Run ON THE GPU HOST (via the device tool, carrying .parts): keep this call's part in /tmp/parts; with a model name,
# the parts are all there: join them into the model cache, sha256-checked against models/catalog.json
# (bench/install_parts.py), so the model resolves by its catalog name. /tmp survives only while the machine is warm
# (chain the calls: it is given back after 30 s idle).
#   bash bench/device/receive.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/parts && cp .parts/* /tmp/parts/
echo "parts on the host: $(ls /tmp/parts | tr '\n' ' ')"
if [ $# -ge 1 ]; then
    source bench/device/setup.sh
    python3 bench/install_parts.py "$1" /tmp/parts/"$1".*
fi

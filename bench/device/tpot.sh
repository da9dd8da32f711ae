#!/usr/bin/env bash
# Run ON THE GPU HOST (carrying .whl and .parts; the model placed by receive.sh): batch-1 TPOT through the engine
# (bench/engine_tpot.py) at CONTEXT tokens with the unread-background term off and on, per selection, into $OUT:
# one JSON per CASE "SELECTION:BACKGROUND" (FLUXION_SELECTION x FLUXION_BACKGROUND).
#   MODEL=qwen2.5-coder-0.5b CONTEXT=32768 CASES="auto:off gpu:all cpu:all" bash bench/device/tpot.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/setup.sh || exit 1
commit=$(cat .parts/commit 2>/dev/null || echo unknown)
for case in ${CASES:-auto:off gpu:all cpu:all}; do
    IFS=: read -r sel bg <<<"$case"
    out="$OUT/engine_tpot_${MODEL:?}_${CONTEXT:-32768}_b1_sel${sel}_bg${bg}_h200_$commit.json"
    FLUXION_SELECTION=$sel FLUXION_BACKGROUND=$bg timeout "${TMO:-200}" python3 bench/engine_tpot.py --gguf "$MODEL" \
        --contexts "${CONTEXT:-32768}" --batches 1 --modes fluxion --device cuda --out "$out"
    echo "case $case: rc $?"
done

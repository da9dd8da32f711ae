#!/usr/bin/env bash
# Run ON THE GPU HOST (carrying .whl and .ruler_ids40; the model placed by receive.sh): RULER answers of MODEL into
# $OUT, one bench/ruler_split.py answer per entry of RUNS, each cut at TMO seconds (its checkpoint keeps what it
# answered). Score here afterwards: python bench/ruler_split.py score --model MODEL --dir .ruler_ids40 --answers F
#   MODEL=qwen2.5-coder-0.5b RUNS="16384:0:40 32768:0:20" ARGS="--modes full fluxion" TAG=x SEL=auto TMO=290 \
#       bash bench/device/ruler.sh
# RUNS: LENGTH:FROM:PER entries (samples FROM .. FROM + PER - 1 of each task); SEL: FLUXION_SELECTION (auto, cpu, gpu);
# ARGS: more ruler_split answer options (--modes, --plan FILE, --tasks ...).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/setup.sh || exit 1
commit=$(cat .parts/commit 2>/dev/null || echo unknown)
for run in ${RUNS:?}; do
    IFS=: read -r len from per <<<"$run"
    out="$OUT/ruler_answers_${MODEL:?}_${len}_h200_from${from}_to$((from + per))_${TAG:?}_sel${SEL:-auto}_$commit.json"
    FLUXION_SELECTION=${SEL:-auto} timeout "${TMO:-290}" python3 bench/ruler_split.py answer --gguf "$MODEL" \
        --dir .ruler_ids40 --lengths "$len" ${ARGS:-} --from-index "$from" --per-task "$per" --device cuda \
        --dtype bfloat16 --max-batch 64 --checkpoint-s 20 --out "$out"
    echo "run $run: rc $? -> $(basename "$out")"
done

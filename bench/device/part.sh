#!/usr/bin/env bash
# Run HERE before each model-carrying device call: .parts/ holds only part NN of MODEL's GGUF (from prepare.sh),
# and .parts/commit the checkout's commit (ruler.sh / tpot.sh name their files by it: the GPU host gets no .git).
#   bash bench/device/part.sh MODEL NN        e.g. bash bench/device/part.sh qwen2.5-coder-0.5b 03
# The call then carries .parts and runs `bash bench/device/receive.sh` (the last part: receive.sh MODEL).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .parts && mkdir .parts
cp "/tmp/parts_$1/$2" ".parts/$1.$2"
git rev-parse --short HEAD > .parts/commit
echo "staged $1 part $2 of $(ls "/tmp/parts_$1" | wc -l)"

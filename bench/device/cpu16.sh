#!/usr/bin/env bash
# ON THE GPU HOST, CPU only (carrying .whl and .hdr): the 16-thread table of bench/speed.py, ours against llama.cpp,
# over random-weight twins of the catalog files (the real header, tokenizer and block types; random blocks written
# there in seconds instead of carrying the files). Here, once:
#   for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
#       python bench/random_gguf.py --header-of ~/.cache/fluxion-lite/models/$m.gguf .hdr/$m.header; done
# Device command (~7 min; JSON under $OUT):  bash bench/device/cpu16.sh
set -u
source bench/device/setup.sh || exit 1
ln -sfn "$PWD/models" fluxion_lite/models  # the twins carry the catalog names: their shipped plans resolve
mkdir -p /tmp/m
for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
    [ -f /tmp/m/$m.gguf ] || python3 bench/random_gguf.py --like .hdr/$m.header /tmp/m/$m.gguf > /dev/null || exit 1
done
lscpu | grep -E "Model name"
rows='^(/tmp|model|machine|wrote)'
python3 bench/speed.py --models /tmp/m/qwen2.5-coder-0.5b.gguf /tmp/m/qwen2.5-coder-1.5b.gguf --contexts 16384 \
    --threads 16 --attention full fluxion --out "$OUT/speed_gpuhost_16t_16k.json" 2>&1 | grep -E "$rows"
python3 bench/speed.py --models /tmp/m/smollm2-135m.gguf /tmp/m/qwen2.5-coder-0.5b.gguf \
    /tmp/m/qwen2.5-coder-1.5b.gguf --contexts 512 4096 --threads 16 --out "$OUT/speed_gpuhost_16t.json" 2>&1 \
    | grep -E "$rows"

#!/usr/bin/env bash
# Run HERE (the CPU machine), once per checkout, before the GPU host's calls: what the GPU host lacks.
#   bash bench/device/prepare.sh [MODEL ...]        (default: qwen2.5-coder-0.5b)
# - .whl/: cp312 wheels of what the H200 image lacks (its torch and numpy are there): cffi, pycparser (the native
#   build), gguf with pyyaml, tqdm, requests and their small needs (the loader). Versions as in this venv.
# - /tmp/parts_<MODEL>/NN: the model's GGUF in 50 MB parts (one travels per call: part.sh puts it in .parts/).
# - .ruler_ids40/: the RULER prompts as token ids, 40 samples a task at 4K-32K (the GPU host cannot tokenise;
#   bench/ruler_split.py export, deterministic: the same ids every time; ~15 min on 2 cores for all four lengths).
# Everything here is ignored by git (.git/info/exclude); the device README says why wheels travel this way.
set -euo pipefail
cd "$(dirname "$0")/../.."
models=("${@:-qwen2.5-coder-0.5b}")
for p in /.whl/ /.parts/ /.ruler_ids40/; do
    grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude
done
pyver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
for pkg in cffi pycparser gguf PyYAML tqdm requests urllib3 idna certifi charset-normalizer; do
    ls .whl | grep -qi "^${pkg//-/_}-" && continue
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$pkg==$(pyver "$pkg")"
done
for m in "${models[@]}"; do
    .venv/bin/fluxion-lite pull "$m"
    gguf=$(.venv/bin/python -c "from fluxion_lite.hub.catalog import get_model, local_path; print(local_path(get_model('$m')))")
    if [ ! -d "/tmp/parts_$m" ]; then
        mkdir -p "/tmp/parts_$m" && split -b 50M -d -a 2 "$gguf" "/tmp/parts_$m/"
    fi
    echo "$m: $(ls "/tmp/parts_$m" | wc -l) parts in /tmp/parts_$m"
    for n in 4096 8192 16384 32768; do
        [ -f ".ruler_ids40/${m}_$n.ids.xz" ] && continue
        .venv/bin/python bench/ruler_split.py export --model "$m" --lengths "$n" --samples 40 --dir .ruler_ids40
    done
done
du -sh .whl .ruler_ids40

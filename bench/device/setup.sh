#!/usr/bin/env bash
# SOURCE ON THE GPU HOST (carrying .whl): the carried wheels into /tmp/site on PYTHONPATH, the native library built
# in place (native/build_native.py), the repo importable. Idempotent within a warm machine.
#   source bench/device/setup.sh
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || return 1
if [ ! -d /tmp/site/cffi ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || return 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ls fluxion_lite/_native*.so >/dev/null 2>&1 || python3 native/build_native.py >/tmp/native_build.log 2>&1 \
    || { tail -20 /tmp/native_build.log; return 1; }
python3 -c "import fluxion_lite.hostkv.native, torch; print('ready:', torch.__version__, torch.cuda.get_device_name(0))"

# llama.cpp peer rows on the GPU host through the device tool, idempotent across back-to-back calls (the machine keeps
# /tmp while warm). Run from the repository root with .whl (the gguf wheel and friends) and .peer/llama.cpp.tgz
# (bench/llamacpp_peer.py trim) carried. Starts the CUDA build and the 16 GB GGUF in new process sessions (they
# outlive the call), waits, then runs; the JSON lands in $OUT.
#   call 1: WAIT=540 RUNMAX=250 bash bench/llamacpp_peer/device_run.sh   (build ~340 s on 16 cores)
#   call 2: WAIT=5 RUNMAX=100 bash bench/llamacpp_peer/device_run.sh     (the run: ~305 s for 8K-128K)
# WAIT: seconds this call may wait for the build; RUNMAX: start the run only if this call is younger than that.
set -u
T0=$(date +%s)
mkdir -p /tmp/peer
if [ ! -e /tmp/peer/site.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/peer/site.ok
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ ! -e /tmp/peer/started ]; then
  touch /tmp/peer/started
  nproc; free -g | head -2; df -h /tmp | tail -1; cmake --version | head -1; nvcc --version | tail -1
  setsid nohup sh -c 'python3 bench/llamacpp_peer.py build .peer/llama.cpp.tgz /tmp/peer --cuda-arch 90 && touch /tmp/peer/build.done' > /tmp/peer/build.log 2>&1 < /dev/null &
  setsid nohup sh -c 'python3 bench/llamacpp_peer.py gguf --shape llama3.1-8b /tmp/peer/llama3.1-8b-f16.gguf && touch /tmp/peer/gguf.done' > /tmp/peer/gguf.log 2>&1 < /dev/null &
fi
while [ $(( $(date +%s) - T0 )) -lt ${WAIT:-400} ]; do
  [ -e /tmp/peer/build.done ] && [ -e /tmp/peer/gguf.done ] && break
  sleep 10
done
echo "== waited $(( $(date +%s) - T0 )) s"
echo "== build.log"; grep -E "^\[ *[0-9]+%\]|built|rror" /tmp/peer/build.log | tail -5
echo "== gguf.log"; tail -3 /tmp/peer/gguf.log
if [ -e /tmp/peer/build.done ] && [ -e /tmp/peer/gguf.done ] && [ $(( $(date +%s) - T0 )) -lt ${RUNMAX:-260} ]; then
  python3 bench/llamacpp_peer.py run --bin /tmp/peer/peer_step --model /tmp/peer/llama3.1-8b-f16.gguf \
    --depths ${DEPTHS:-8192 32768 65536 131072} --steps 16 --threads 16 --out $OUT/llamacpp_peer_llama3.1-8b_h200.json
fi
cp /tmp/peer/build.log /tmp/peer/gguf.log $OUT/ 2>/dev/null
true

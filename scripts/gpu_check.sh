#!/usr/bin/env bash
# The GPU machine's checks: the `cuda` tests, the benchmark's `gpu` section, and its many cores
# (the multi-worker server's scaling and a busy host).
#
# For a machine with Python 3.12, torch with CUDA, numpy, msgpack and pytest, but no Twisted,
# no Redis and no package index.  What the machine lacks is installed (into /tmp, nothing
# system-wide) from the gpu-machine tools (wheels/: Twisted and every dependency it declares;
# debs/: Redis), found in the first of: the folder $GPU_CHECK_TOOLS names,
# ../shared/tools/gpu-machine beside the checkout, .device/ of the checkout.  Then it runs, in under six
# minutes in all, eight with the cores step (each step is ended at its limit: 190 s, 115 s
# and 150 s, 15 s more to end):
#
#   pytest -m cuda                                     every test marked `cuda`
#   python -m benchmarks --profile quick --sections gpu   the section's figures and goals
#   python -m benchmarks --profile cores                  the machine's cores: 14 clients against
#                                                         --workers 1, 2, 4, 8 beside Redis, and a
#                                                         busy host (GPU_CHECK_CORES=0 leaves it out)
#
# Logs and results go to $OUT when it is set (else .device/out): cuda-tests.log,
# cuda-tests.xml, bench.log and bench/latest.{json,md}, cores.log and cores/latest.{json,md}.
# Exit status: 0 when every step ran and every test passed (goals may miss: a benchmark is
# not a test), 1 when something failed or ran out of time, 2 when this machine has no CUDA device (nothing was run;
# GPU_CHECK_WITHOUT_CUDA=1 runs the flow anyway, every check skipping: how it is checked
# on a machine without a GPU).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/.device/out}"
SITE=/tmp/tensorshare-gpu-site
LINKS=/tmp/tensorshare-gpu-links
mkdir -p "$OUT"

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    if [ "${GPU_CHECK_WITHOUT_CUDA:-0}" != 1 ]; then
        echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false, or no torch): nothing to check"
        exit 2
    fi
    echo "gpu_check: no CUDA device; going on as asked (GPU_CHECK_WITHOUT_CUDA=1): the checks skip"
fi

# Where the gpu-machine tools are (wheels/, debs/).
TOOLS=""
for candidate in "${GPU_CHECK_TOOLS:-}" "$ROOT/../shared/tools/gpu-machine" "$ROOT/.device"; do
    if [ -n "$candidate" ] && ls "$candidate"/wheels/*.whl >/dev/null 2>&1; then
        TOOLS=$(cd "$candidate" && pwd)
        break
    fi
done
# What the machine lacks: Twisted and its dependencies, from those wheels.
if ! "$PY" -c 'import twisted' 2>/dev/null; then
    if [ -z "$TOOLS" ]; then
        echo "gpu_check: Twisted is not installed and no wheels were found (GPU_CHECK_TOOLS," \
             "../shared/tools/gpu-machine, .device: each a folder holding wheels/)"
        exit 1
    fi
    echo "gpu_check: installing Twisted from $TOOLS/wheels"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$TOOLS"/wheels/*.whl || exit 1
fi
# server/ imports as tensorshare_server once installed: a link stands in for pip install.
mkdir -p "$LINKS" && ln -sfn "$ROOT/server" "$LINKS/tensorshare_server"
export PYTHONPATH="$SITE:$ROOT:$LINKS${PYTHONPATH:+:$PYTHONPATH}"
# Redis, from the debs beside the wheels (the cores step runs one beside the server).
if ! command -v redis-server >/dev/null && [ -n "$TOOLS" ] && ls "$TOOLS"/debs/*.deb >/dev/null 2>&1; then
    for f in "$TOOLS"/debs/*.deb; do dpkg -x "$f" /tmp/rd || exit 1; done
    export LD_LIBRARY_PATH="/tmp/rd/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    ln -sfn /tmp/rd/usr/bin/redis-check-rdb /tmp/rd/redis-server  # redis picks its role from its name
    export PATH="/tmp/rd:$PATH"
fi
export PYTHONUNBUFFERED=1
"$PY" -c 'import tensorshare, tensorshare_server, twisted' || exit 1
"$PY" - <<'PY'
import torch
where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"gpu_check: {where}, torch {torch.__version__}", flush=True)
PY

status=0
# The test files holding `cuda` tests (collecting every file would import optional
# packages this machine lacks).
files=$(grep -l "pytest.mark.cuda" tests/test_*.py)
# SIGINT first: pytest then tears its fixtures down (servers, the processes tests started) and exits.
timeout -s INT -k 15 190 "$PY" -m pytest -m cuda $files -q -rs -p no:cacheprovider \
    --junitxml "$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.log" || status=1
timeout -k 15 115 "$PY" -m benchmarks --profile quick --sections gpu --out "$OUT/bench" \
    2>&1 | tee "$OUT/bench.log" || status=1
if [ "${GPU_CHECK_CORES:-1}" != 0 ]; then
    timeout -k 15 150 "$PY" -m benchmarks --profile cores --out "$OUT/cores" \
        2>&1 | tee "$OUT/cores.log" || status=1
fi
echo "gpu_check: done (status $status); results in $OUT"
exit $status

#!/usr/bin/env bash
# The whole GPU session in one command, on the H200 (device tool): install what travels, run the GPU tests,
# then tune every built-in op twice in both modes (tools/stability_bench.py). Results land in $OUT.
#   run: bash tools/gpu_run.sh        carry: [".whl", ".gpu"]   (.gpu from tools/fetch_gpu_packages.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/autosel-gpu}
mkdir -p "$OUT"
# Pure-Python dependencies the GPU image lacks (sqlite-utils and friends), downloaded by:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl \
#       sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group click==8.4.0 platformdirs==4.14.8
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
if [ -f .gpu/activate.sh ]; then . .gpu/activate.sh; fi   # flashinfer and sgl-kernel (docs/GPU_BACKENDS.md)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export AUTOSEL_DB=/tmp/autosel-user.db
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import autosel.platforms as p; print(p.current_platform())" | tee -a "$OUT/gpu.txt"
timeout ${TESTS_TIMEOUT_S:-300} python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider 2>&1 | tail -40 \
    | tee "$OUT/gpu_tests.txt"
timeout ${BENCH_TIMEOUT_S:-300} python3 tools/stability_bench.py --out "$OUT" --budget-s ${BUDGET_S:-40} ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^  \[" | tail -60
rm -f "$OUT/tune2.db"   # $OUT returns at most 8 files; tune1.db holds the decisions

#!/usr/bin/env bash
# The Triton launch paths and the start-up benchmark on the GPU machine, in one command: the GPU tests of the
# launch and the ops (parity of the C paths with the Python wrappers), tools/bench_triton_launch.py (host time per
# launch: Triton's, torch's StaticallyLaunchedCudaKernel, autosel's C), then `autosel bench startup` on the shipped
# DB. Result files land in $OUT/results; copy them into results/ and run `autosel bench page`.
#   run: bash dev/launch_startup_run.sh     carry: [".whl", ".gpu"]
# env: AUTOSEL_COMMIT (recorded where there is no git checkout), TOTAL_S (560), TESTS_S (150), LAUNCH_S (200)
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-560}))
left() { local s=$((deadline - SECONDS)); echo $((s > 1 ? s : 1)); }
cap() { local l; l=$(left); echo $((l < $1 ? l : $1)); }
. dev/gpu_env.sh || exit 1
cat "$OUT/gpu.txt"; mkdir -p "$OUT/results"
timeout "$(cap ${TESTS_S:-150})" python3 -m pytest tests/gpu/test_triton_launch_gpu.py tests/gpu/test_triton_kernels_gpu.py \
  tests/gpu/test_ops_gpu.py -q -p no:cacheprovider > "$OUT/launch_tests.txt" 2>&1
tail -3 "$OUT/launch_tests.txt"
timeout "$(cap ${LAUNCH_S:-200})" python3 tools/bench_triton_launch.py --out "$OUT/results/triton_launch.json" \
  > "$OUT/triton_launch.log" 2>&1
tail -30 "$OUT/triton_launch.log"
timeout "$(left)" python3 -m autosel bench startup --rounds 5 --results "$OUT/results" > "$OUT/startup.log" 2>&1
tail -30 "$OUT/startup.log"

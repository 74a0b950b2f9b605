#!/usr/bin/env bash
# The paged attention backends on the GPU machine in one command: install what travels (tools/gpu_env.sh), build
# flashinfer's attention modules in parallel, run their GPU tests, then tools/attention_bench.py. Results land in $OUT:
# attention_tests.txt, attention_bench.{json,md}, and fi_attn_aot.tar.xz (the built modules; copied to .gpu/, the
# next machine loads them as flashinfer AOT modules instead of compiling, see docs/GPU_BACKENDS.md).
#   run: bash tools/attention_gpu_run.sh     carry: [".whl", ".gpu"]
# env: AUTOSEL_COMMIT (recorded in the JSON), TOTAL_S (540), TESTS_TIMEOUT_S (220), BENCH_ARGS,
#      GPU_TESTS (tests/gpu/test_attention_gpu.py tests/test_attention_triton.py)
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-540}))
left() { local s=$((deadline - SECONDS)); echo $((s > 1 ? s : 1)); }
. tools/gpu_env.sh || exit 1
# flashinfer's attention modules built on an earlier machine (this script's fi_attn_aot.tar.xz): loaded as AOT
# modules, so the prewarm below has nothing to compile.
if [ -f .gpu/fi_attn_aot.tar.xz ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && tar -xJf .gpu/fi_attn_aot.tar.xz -C /tmp/site/flashinfer/data/aot || exit 1
fi
# FA3's carried library holds zeroed cubins for what autosel never calls (tools/trim_fa3.py): load modules lazily.
export CUDA_MODULE_LOADING=LAZY
cat "$OUT/gpu.txt"
began=$SECONDS
timeout "$(left)" python3 tools/attention_prewarm.py 2>&1 | tail -8
echo "prewarm wall $((SECONDS - began)) s"
tests_s=$(left); [ "$tests_s" -gt "${TESTS_TIMEOUT_S:-220}" ] && tests_s=${TESTS_TIMEOUT_S:-220}
timeout "$tests_s" python3 -m pytest ${GPU_TESTS:-tests/gpu/test_attention_gpu.py tests/test_attention_triton.py} -q -p no:cacheprovider -rs \
  > "$OUT/attention_tests.txt" 2>&1
tail -25 "$OUT/attention_tests.txt"
timeout "$(left)" python3 tools/attention_bench.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/attention_bench.log" 2>&1
tail -5 "$OUT/attention_bench.log"; cat "$OUT/attention_bench.md" 2>/dev/null
ops="${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}/.cache/flashinfer/0.7.4/90a/cached_ops"
[ -d "$ops" ] && (mkdir -p /tmp/aot && for m in "$ops"/*/; do n=$(basename "$m"); [ -f "$m/$n.so" ] && mkdir -p \
  "/tmp/aot/$n" && cp "$m/$n.so" "/tmp/aot/$n/"; done; tar -cJf "$OUT/fi_attn_aot.tar.xz" -C /tmp/aot .)
ls -la "$OUT"

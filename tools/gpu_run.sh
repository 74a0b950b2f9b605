#!/usr/bin/env bash
# The whole GPU session in one command, on the H200 (device tool): install what travels, run the GPU tests,
# then tune every built-in op twice in both modes (tools/stability_bench.py). Results land in $OUT.
#   run: bash tools/gpu_run.sh        carry: [".whl", ".gpu"]   (.gpu from tools/fetch_gpu_packages.sh)
# With two GPUs (nvidia-h200-x2) the tests and the two tunes run side by side: tune 1 on GPU 0 after the
# tests, tune 2 on GPU 1, so the two fresh tunes are also two devices of one kind.
# env: GPU_TESTS (default tests/gpu; "none" skips), TESTS_TIMEOUT_S (420), BUDGET_S (20), BENCH_ARGS,
#      TOTAL_S (560: everything is stopped by then, so the DBs are saved within the device's 600 s),
#      RUNS (1: how many two-tune runs, one after the other, into bench, bench-2, bench-3, ...)
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-560}))
. tools/gpu_env.sh || exit 1
cat "$OUT/gpu.txt"
left() { echo $((deadline - SECONDS)); }
runs=${RUNS:-1}
dir() { [ "$1" = 1 ] && echo "$OUT/bench" || echo "$OUT/bench-$1"; }
bench() {  # bench N: tune N of every run of the stability benchmark, stopped at the deadline
  for r in $(seq "$runs"); do
    mkdir -p "$(dir "$r")"
    timeout "$(left)" python3 tools/stability_bench.py --out "$(dir "$r")" --budget-s "${BUDGET_S:-20}" \
      ${BENCH_ARGS:-} --index "$1" > "$(dir "$r")/tune$1.log" 2>&1
  done
}
run_tests() {
  [ "${GPU_TESTS:-}" = none ] && return
  timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
}
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  (export CUDA_VISIBLE_DEVICES=0; run_tests; bench 1) &
  CUDA_VISIBLE_DEVICES=1 bench 2
  wait
else
  run_tests; bench 1; bench 2
fi
# A process killed by its timeout leaves its DB's last decisions in the WAL: fold them into the file.
python3 -c "import glob, sqlite3; [sqlite3.connect(f).execute('PRAGMA wal_checkpoint(TRUNCATE)') for f in glob.glob('$OUT/bench*/*.db')]"
tail -5 "$OUT/gpu_tests.txt" 2>/dev/null
for r in $(seq "$runs"); do
  d=$(dir "$r")
  [ -f "$d/tune2.db" ] && python3 tools/stability_bench.py --out "$d" --compare > /dev/null 2>&1
  echo "== $d"; grep -h "^ *\[.*\] .* \(chosen\|rejected\)" "$d"/tune?.log | tail -20; grep -h "^| \(eager\|graph\|autosel\)" "$d/stability.md"
done
(cd "$OUT" && tar -czf bench.tar.gz bench* && rm -rf bench bench-*)   # $OUT returns at most 8 files

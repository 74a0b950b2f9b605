#!/usr/bin/env bash
# The whole GPU session in one command, on the H200 (device tool): install what travels, run the GPU tests,
# then tune every built-in op twice in both modes (tools/stability_bench.py). Results land in $OUT.
#   run: bash tools/gpu_run.sh        carry: [".whl", ".gpu"]   (.gpu from tools/fetch_gpu_packages.sh)
# With two GPUs (nvidia-h200-x2) the tests and the two tunes run side by side: tune 1 on GPU 0 after the
# tests, tune 2 on GPU 1, so the two fresh tunes are also two devices of one kind.
# env: GPU_TESTS (default tests/gpu; "none" skips), TESTS_TIMEOUT_S (420), BUDGET_S (20), BENCH_ARGS,
#      TOTAL_S (560: everything is stopped by then, so the DBs are saved within the device's 600 s),
#      RUNS (1: how many two-tune runs, one after the other, into bench, bench-2, bench-3, ...)
# BENCH=heldout instead: one fresh `autosel tune` into $OUT/tune.db, then tools/heldout_bench.py on it (eager
# and graph; on two GPUs the tests and the graph half on GPU 0, the tune and the eager half on GPU 1), and
# tools/dispatch_bench.py on this host; the flashinfer modules built on the way come back as fi_aot.tar.gz.
# HELDOUT_MODES (one GPU; default "eager graph"); HELDOUT_ARGS (e.g. "--shapes set1": the shapes of
# docs/BENCHMARKS.md section 2; default set2); a tune.db already in $OUT (carried) is reused, not retuned.
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-560}))
. tools/gpu_env.sh || exit 1
cat "$OUT/gpu.txt"
# Seconds to the deadline, at least 1: GNU timeout reads 0 as no limit and refuses a negative one (exit 125).
left() { local s=$((deadline - SECONDS)); echo $((s > 1 ? s : 1)); }
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
heldout() {  # heldout MODE: the held-out benchmark in one mode, on the DB the tune wrote
  AUTOSEL_DB=$OUT/tune.db AUTOSEL_TUNE=off timeout "$(left)" python3 tools/heldout_bench.py --out "$OUT/heldout-$1" \
    --mode "$1" ${HELDOUT_ARGS:-} > "$OUT/heldout-$1.log" 2>&1
}
if [ "${BENCH:-stability}" = heldout ]; then
  tune() {
    [ -f "$OUT/tune.db" ] && { touch "$OUT/tuned"; return; }
    local began=$SECONDS
    timeout "$(left)" python3 -m autosel tune --db "$OUT/tune.db" --force --budget-s "${BUDGET_S:-20}" --json \
      > "$OUT/tune.json" 2> "$OUT/tune.log"
    echo "tune wall $((SECONDS - began)) s" >> "$OUT/tune.log"
    touch "$OUT/tuned"
  }
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=1; tune; heldout eager) &
    (export CUDA_VISIBLE_DEVICES=0; run_tests
     while [ ! -f "$OUT/tuned" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 2; done
     heldout graph)
    wait
  else
    run_tests; tune; for mode in ${HELDOUT_MODES:-eager graph}; do heldout "$mode"; done
  fi
  python3 tools/dispatch_bench.py > "$OUT/dispatch_bench.md" 2>&1
  python3 -c "import sqlite3; sqlite3.connect('$OUT/tune.db').execute('PRAGMA wal_checkpoint(TRUNCATE)')"
  tail -3 "$OUT/gpu_tests.txt" 2>/dev/null; tail -2 "$OUT/tune.log"; cat "$OUT/dispatch_bench.md"
  cat "$OUT"/heldout-*/heldout.md 2>/dev/null
  ops="${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}/.cache/flashinfer/0.7.4/90a/cached_ops"
  [ -d "$ops" ] && (mkdir -p /tmp/aot && for m in "$ops"/*/; do n=$(basename "$m"); [ -f "$m/$n.so" ] && mkdir -p \
    "/tmp/aot/$n" && cp "$m/$n.so" "/tmp/aot/$n/"; done; tar -czf "$OUT/fi_aot.tar.gz" -C /tmp/aot .)
  (cd "$OUT" && tar -czf results.tar.gz heldout-* tune.* dispatch_bench.md gpu.txt && rm -rf heldout-* tune.* tuned)
  exit 0
fi
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

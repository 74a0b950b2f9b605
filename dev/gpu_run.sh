#!/usr/bin/env bash
# This repository's own GPU runs (device tool), in one command: install what travels, run the GPU tests, then the
# benchmarks, writing result files (autosel.bench.results) into $OUT/results; copy those into results/ and run
# `autosel bench page` to publish them.
#   run: bash dev/gpu_run.sh        carry: [".whl", ".gpu"]   (.gpu from dev/fetch_gpu_packages.sh)
# env: GPU_TESTS (default tests/gpu; "none" skips), TESTS_TIMEOUT_S (420), BUDGET_S (20), TOTAL_S (560: everything
#      is stopped by then, within the device's 600 s), BENCH: stability (default: two fresh tunes) or heldout (one
#      fresh `autosel tune` into $OUT/tune.db, the held-out benchmark on it, then the hot path); HELDOUT_ARGS
#      (e.g. "--seed 7 --mode eager"); a tune.db already in $OUT (carried) is reused, not retuned.
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-560}))
. dev/gpu_env.sh || exit 1
cat "$OUT/gpu.txt"
# Seconds to the deadline, at least 1: GNU timeout reads 0 as no limit and refuses a negative one (exit 125).
left() { local s=$((deadline - SECONDS)); echo $((s > 1 ? s : 1)); }
if [ "${GPU_TESTS:-}" != none ]; then
  timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
if [ "${BENCH:-stability}" = heldout ]; then
  if [ ! -f "$OUT/tune.db" ]; then
    timeout "$(left)" python3 -m autosel tune --db "$OUT/tune.db" --force --budget-s "${BUDGET_S:-20}" --json \
      > "$OUT/tune.json" 2> "$OUT/tune.log"
  fi
  AUTOSEL_DB=$OUT/tune.db AUTOSEL_TUNE=off timeout "$(left)" python3 -m autosel bench heldout \
    --results "$OUT/results" ${HELDOUT_ARGS:-} > "$OUT/heldout.log" 2>&1
  timeout "$(left)" python3 -m autosel bench hot-path --results "$OUT/results" > "$OUT/hot_path.log" 2>&1
  # A process killed by its timeout leaves its DB's last decisions in the WAL: fold them into the file.
  python3 -c "import sqlite3; sqlite3.connect('$OUT/tune.db').execute('PRAGMA wal_checkpoint(TRUNCATE)')"
  # The flashinfer modules compiled on the way, for dev/fetch_gpu_packages.sh to ship as AOT modules next time.
  ops="${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}/.cache/flashinfer/0.7.4/90a/cached_ops"
  [ -d "$ops" ] && (mkdir -p /tmp/aot && for m in "$ops"/*/; do n=$(basename "$m"); [ -f "$m/$n.so" ] && mkdir -p \
    "/tmp/aot/$n" && cp "$m/$n.so" "/tmp/aot/$n/"; done; tar -czf "$OUT/fi_aot.tar.gz" -C /tmp/aot .)
else
  timeout "$(left)" python3 -m autosel bench stability --budget-s "${BUDGET_S:-20}" --keep "$OUT/tunes" \
    --results "$OUT/results" > "$OUT/stability.log" 2>&1
  (cd "$OUT" && tar -czf tunes.tar.gz tunes && rm -rf tunes)   # $OUT returns at most 8 files
fi
tail -2 "$OUT"/*.log
(cd "$OUT" && tar -czf results.tar.gz results && rm -rf results)

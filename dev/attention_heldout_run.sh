#!/usr/bin/env bash
# attention's proof on the GPU machine in one command, each phase within what is left of TOTAL_S: the attention GPU
# tests, transformers' continuous batching on the GPU, the graph-timing probe (dev/attention_graph_probe.py), two
# fresh tunes of attention.* in both modes (`autosel bench stability`: the decisions the two made alike and each
# tune's wall time, tune1.db and tune2.db kept), the held-out benchmark on the first tune's DB
# (`autosel bench attention-heldout`), then the model step (`autosel bench attention-step`), each writing its result
# file into the results folder (a phase killed at its cap leaves its working copy, *.partial.json, there), and the
# benchmarks page rendered from that folder. Everything lands in $OUT/attention_results.tar.gz (the device returns 8
# files); copy the result files into results/ and run `autosel bench page`.
#   run: bash dev/attention_heldout_run.sh     carry: [".whl", ".gpu"] (and ".hfw" for the transformers test)
# env: AUTOSEL_COMMIT, TOTAL_S (400), TUNE_BUDGET_S (20: seconds of timing per op and mode), SEED (47: the held-out
# batches'; judge a change on a seed its choices did not see); each phase's most seconds, 0 to skip it: TESTS_S (40), PAGED_S (120: tests/gpu/test_transformers_paged_gpu.py),
# PROBE_S (40: dev/attention_graph_probe.py), TUNES_S (210), HELDOUT_S (110);
# each keeps what the tunes (100 s) and the held-out run (40 s) need at least; the model step gets what is left.
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-400}))
left() { local s=$((deadline - SECONDS - ${1:-0})); echo $((s > 1 ? s : 1)); }
cap() { local l; l=$(left "$2"); echo $((l < $1 ? l : $1)); }  # cap SECONDS RESERVED: the lesser of SECONDS and what is left
. dev/gpu_env.sh || exit 1
if [ -f .gpu/fi_attn_aot.tar.xz ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && tar -xJf .gpu/fi_attn_aot.tar.xz -C /tmp/site/flashinfer/data/aot || exit 1
fi
export CUDA_MODULE_LOADING=LAZY
R=/tmp/attention_results && mkdir -p $R && cp "$OUT/gpu.txt" $R/
pack() { tar -czf "$OUT/attention_results.tar.gz" -C $R . ; }
section() {  # the section of the benchmarks page rendered from the result files so far whose heading starts with $1
  python3 -m autosel bench page --results $R/results --out $R/BENCHMARKS.md > /dev/null &&
    awk -v h="## $1" 'index($0, h) == 1 { p = 1; print; next } p && /^## / { exit } p' $R/BENCHMARKS.md
}
trap pack EXIT
echo "setup $SECONDS s"; cat $R/gpu.txt
began=$SECONDS
if [ "${TESTS_S:-40}" -gt 0 ]; then
  timeout "$(cap ${TESTS_S:-40} 100)" python3 -m pytest tests/gpu/test_attention_gpu.py tests/test_attention_triton.py -q \
    -p no:cacheprovider -rs > $R/attention_tests.txt 2>&1
  tail -3 $R/attention_tests.txt; echo "tests wall $((SECONDS - began)) s"; pack
fi
began=$SECONDS  # transformers' continuous batching through autosel's attention: skipped unless .hfw (5.24) is carried
if [ "${PAGED_S:-120}" -gt 0 ]; then
  timeout "$(cap ${PAGED_S:-120} 100)" python3 -m pytest tests/gpu/test_transformers_paged_gpu.py -q -p no:cacheprovider \
    -rs > $R/transformers_paged_tests.txt 2>&1
  tail -3 $R/transformers_paged_tests.txt; echo "paged transformers tests wall $((SECONDS - began)) s"; pack
fi
began=$SECONDS  # a decode plan's graph time after a copy, a kernel or a projection, against back-to-back replays
if [ "${PROBE_S:-40}" -gt 0 ]; then
  OUT=$R timeout "$(cap ${PROBE_S:-40} 100)" python3 dev/attention_graph_probe.py > $R/graph_probe.log 2>&1
  grep -v Warning $R/graph_probe.log | tail -40; echo "graph probe wall $((SECONDS - began)) s"; pack
fi
began=$SECONDS
timeout "$(cap ${TUNES_S:-210} 40)" python3 -m autosel bench stability --op 'attention.*' \
  --budget-s "${TUNE_BUDGET_S:-20}" --keep $R/tune --results $R/results > $R/tunes.log 2>&1
tail -20 $R/tunes.log; echo "two tunes wall $((SECONDS - began)) s"; pack
began=$SECONDS
hs=$(cap ${HELDOUT_S:-110} 0)
AUTOSEL_DB=$R/tune/tune1.db AUTOSEL_TUNE=off timeout "$hs" python3 -m autosel bench attention-heldout \
  --results $R/results --seed "${SEED:-47}" --rounds 7 --decode 32 --extend 16 --deadline-s $((hs > 25 ? hs - 15 : 10)) > $R/heldout.log 2>&1
tail -3 $R/heldout.log; section "Paged attention on held-out"; echo "held-out wall $((SECONDS - began)) s"; pack
began=$SECONDS
AUTOSEL_DB=$R/tune/tune1.db AUTOSEL_TUNE=off timeout "$(left 5)" python3 -m autosel bench attention-step \
  --results $R/results --deadline-s "$(left 25)" > $R/model_step.log 2>&1
tail -2 $R/model_step.log; section "Paged attention in a model step"; echo "model step wall $((SECONDS - began)) s"

#!/usr/bin/env bash
# attention's proof on the GPU machine in one command, each phase within what is left of TOTAL_S: the attention GPU
# tests, a fresh tune of attention.* in both modes (tools/stability_bench.py --index 1: tune1.db, its checks and
# timing per op and mode in tune.log), the held-out benchmark on that DB (tools/attention_heldout.py), a second
# fresh tune with the compile caches warm (--index 2) and the two compared (stability.md), then the model step
# (tools/attention_model_step.py). Everything lands in $OUT/attention_results.tar.gz (the tool returns 8 files).
#   run: bash tools/attention_heldout_run.sh     carry: [".whl", ".gpu"]
# env: AUTOSEL_COMMIT, TOTAL_S (400), TUNE_BUDGET_S (20: seconds of timing per op and mode); each phase's most
# seconds: TESTS_S (40), TUNE1_S (150), HELDOUT_S (110), TUNE2_S (80); each keeps what the tune (60 s) and the
# held-out run (40 s) need at least; the second tune and the model step get what is left.
set -uo pipefail
deadline=$((SECONDS + ${TOTAL_S:-400}))
left() { local s=$((deadline - SECONDS - ${1:-0})); echo $((s > 1 ? s : 1)); }
cap() { local l; l=$(left "$2"); echo $((l < $1 ? l : $1)); }  # cap SECONDS RESERVED: the lesser of SECONDS and what is left
. tools/gpu_env.sh || exit 1
if [ -f .gpu/fi_attn_aot.tar.xz ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && tar -xJf .gpu/fi_attn_aot.tar.xz -C /tmp/site/flashinfer/data/aot || exit 1
fi
export CUDA_MODULE_LOADING=LAZY
R=/tmp/attention_results && mkdir -p $R && cp "$OUT/gpu.txt" $R/
pack() { tar -czf "$OUT/attention_results.tar.gz" -C $R . ; }
trap pack EXIT
echo "setup $SECONDS s"; cat $R/gpu.txt
began=$SECONDS
timeout "$(cap ${TESTS_S:-40} 100)" python3 -m pytest tests/gpu/test_attention_gpu.py tests/test_attention_triton.py -q \
  -p no:cacheprovider -rs > $R/attention_tests.txt 2>&1
tail -3 $R/attention_tests.txt; echo "tests wall $((SECONDS - began)) s"; pack
began=$SECONDS
timeout "$(cap ${TUNE1_S:-150} 40)" python3 tools/stability_bench.py --out $R/tune --op 'attention.*' --index 1 \
  --budget-s "${TUNE_BUDGET_S:-20}" > $R/tune1.log 2>&1
grep -E "chosen|took|failed" $R/tune1.log; echo "tune 1 wall $((SECONDS - began)) s"; pack
began=$SECONDS
hs=$(cap ${HELDOUT_S:-110} 0)
AUTOSEL_DB=$R/tune/tune1.db AUTOSEL_TUNE=off timeout "$hs" python3 tools/attention_heldout.py \
  --out $R --rounds 7 --decode 32 --extend 16 --deadline-s $((hs > 25 ? hs - 15 : 10)) > $R/heldout.log 2>&1
tail -3 $R/heldout.log; head -12 $R/attention_heldout.md 2>/dev/null; echo "held-out wall $((SECONDS - began)) s"; pack
began=$SECONDS
timeout "$(cap ${TUNE2_S:-80} 0)" python3 tools/stability_bench.py --out $R/tune --op 'attention.*' --index 2 \
  --budget-s "${TUNE_BUDGET_S:-20}" > $R/tune2.log 2>&1
grep -E "chosen|took|failed" $R/tune2.log; echo "tune 2 wall $((SECONDS - began)) s"
[ -f $R/tune/tune2.db ] && timeout 30 python3 tools/stability_bench.py --out $R/tune --compare > $R/compare.log 2>&1
head -20 $R/tune/stability.md 2>/dev/null; pack
began=$SECONDS
AUTOSEL_DB=$R/tune/tune1.db AUTOSEL_TUNE=off timeout "$(left 5)" python3 tools/attention_model_step.py --out $R \
  --deadline-s "$(left 25)" > $R/model_step.log 2>&1
tail -2 $R/model_step.log; cat $R/attention_model_step.md 2>/dev/null; echo "model step wall $((SECONDS - began)) s"

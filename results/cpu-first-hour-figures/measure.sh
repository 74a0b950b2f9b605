#!/usr/bin/env bash
# The README's CPU figures that had no source, on this machine: each in fresh processes, three times.
set -u
PY=${PY:-python}
export PYTHONPATH=$(cd "$(dirname "$0")/../../.." && pwd)  # this checkout
for i in 1 2 3; do
  # torch._dynamo's import, torch already imported
  $PY -c "import time, torch; t = time.perf_counter(); import torch._dynamo; print(f'dynamo_import_s {time.perf_counter() - t:.2f}')"
  # a first torch.compile: rmsnorm's first call in a process, with an empty inductor cache (cold) and the cache it left (warm)
  cache=$(mktemp -d)
  for state in cold warm; do
    TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton $PY -c "
import time, torch
from autosel.ops import compiled
x, w = torch.randn(4, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
t = time.perf_counter(); compiled.rmsnorm(x, w, 1e-6); print(f'first_compile_${state}_s {time.perf_counter() - t:.2f}')"
  done
  rm -rf "$cache"
  # the bytecode cost: importing torch, dynamo and inductor with no bytecode cached or written, against the cache kept
  pyc=$(mktemp -d)
  PYTHONDONTWRITEBYTECODE=1 PYTHONPYCACHEPREFIX=$pyc $PY -c "import time; t = time.perf_counter(); import torch, torch._dynamo, torch._inductor.compile_fx; print(f'imports_no_bytecode_s {time.perf_counter() - t:.2f}')"
  $PY -c "import time; t = time.perf_counter(); import torch, torch._dynamo, torch._inductor.compile_fx; print(f'imports_bytecode_s {time.perf_counter() - t:.2f}')"
  rm -rf "$pyc"
done
# rope's positions past the cache under torch_compile on a CPU (README: "aborts the process")
$PY -c "
import torch
from autosel.ops import compiled
q, k, cache = torch.randn(2, 4096), torch.randn(2, 1024), torch.randn(8, 128)
try:
    compiled.rope(torch.tensor([0, 9]), q, k, 128, cache, True); print('rope_past_cache: no error')
except Exception as e:
    print('rope_past_cache:', type(e).__name__, str(e).splitlines()[0][:120])
"; echo "rope_past_cache exit code $?"

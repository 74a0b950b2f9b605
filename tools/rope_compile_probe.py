"""Probe (call 19-3): the torch_compile rope's compiles over the GPU's representative rope shapes, in check order,
with dynamic=True (before) or torch.compile's default (after). One process per run; prints seconds per compile."""
import sys
import time

import torch

from autosel.ops import torch_impl
from autosel.ops.common import pin_triton_cache_dir
from autosel.ops.embeddings import SHAPES, rope_inputs

pin_triton_cache_dir()
t0 = time.perf_counter()
import torch._inductor.compile_fx  # noqa: E402,F401  (the import is not a compile)
imported = time.perf_counter() - t0
fn = torch.compile(torch_impl.rope, dynamic=True) if sys.argv[1] == "dynamic" else torch.compile(torch_impl.rope)
times = []
for shape in SHAPES.gpu:
    args = rope_inputs(dict(shape, dtype="bfloat16"), "cuda")
    t = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
print(f"{sys.argv[1]:8s} import {imported:.1f} s; compiles total {sum(times):.2f} s:",
      " ".join(f"{x:.2f}" for x in times), flush=True)

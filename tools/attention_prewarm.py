"""Build flashinfer's attention modules for the given layouts in parallel, one process per (dtype, head_dim), so that a
cold GPU machine pays one module's JIT time instead of their sum before tests/gpu/test_attention_gpu.py and
tools/attention_bench.py run. Each process plans and runs a tiny decode (CUDA-core and tensor-core) and extend batch.

    FLASHINFER_WORKSPACE_BASE=/tmp/fiws python3 tools/attention_prewarm.py bfloat16:64 bfloat16:128 float16:128
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(layout: str) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    from autosel.ops import attention_flashinfer as fi
    from paged_attention_cases import make_batch, make_q

    dtype_name, head_dim = layout.split(":")
    dtype = getattr(torch, dtype_name)
    began = time.perf_counter()
    for heads, q_lens in (((32, 8), None), ((64, 8), None), ((32, 8), [3])):
        batch, k, v = make_batch(seq_lens=[5], q_lens=q_lens, page_size=16, num_q_heads=heads[0],
                                 num_kv_heads=heads[1], head_dim=int(head_dim), dtype=dtype, device="cuda")
        plan = fi.DecodePlan(batch) if q_lens is None else fi.ExtendPlan(batch)
        plan.run(make_q(batch, decode=q_lens is None), k, v)
    torch.cuda.synchronize()
    return f"{layout}: {time.perf_counter() - began:.1f} s"


def main(argv=None) -> int:
    layouts = (argv if argv is not None else sys.argv[1:]) or ["bfloat16:64", "bfloat16:128", "bfloat16:256",
                                                              "float16:128"]
    with ProcessPoolExecutor(len(layouts), mp_context=get_context("spawn")) as pool:
        for line in pool.map(build, layouts):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

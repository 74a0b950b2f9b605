"""gemm.mm: a @ b.T as linear layers run it, where small and large token counts favour different kernels."""

from __future__ import annotations

import operator

from autosel.buckets import TracedTokens, token_bucket_up
from autosel.ops.common import DTYPES, ShapesByDevice, dtype_name, dtype_of, standard_specs
from autosel.spec import OpDefinition

# Llama-3-8B's projections (N, K): qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096), down (4096, 14336);
# M is the token count, rounded up to a power of two in the bucket. o at 4, 16, 32 and 64 tokens: which of triton and
# cuBLAS wins o in graph mode on the H200 turns between these buckets (commits c134b65 and bd3f968), so
# each is tuned rather than given its neighbour's winner by the nearest-bucket rule (64 goes to 32 on a tie; 1-4
# tokens had no tuned bucket within a factor of two and ran the op-level cuBLAS, 1.09x triton's time at 4). A
# bucket names its weight (_weight), so none decides for another weight's calls.
SHAPES = ShapesByDevice(
    gpu=tuple({"m": m, "n": n, "k": k} for m, n, k in [
        (1, 6144, 4096), (1, 28672, 4096), (4, 4096, 4096), (16, 4096, 4096), (16, 4096, 14336), (32, 4096, 4096),
        (64, 4096, 4096), (64, 6144, 4096), (128, 4096, 4096), (512, 28672, 4096), (1024, 4096, 14336),
        (4096, 6144, 4096), (8192, 4096, 4096), (16384, 4096, 14336),
    ]),
    # 4 tokens: no token bucket from 1 to 64 without a tuned one within a factor of two (the norms' rule).
    cpu=tuple({"m": m, "n": n, "k": k} for m, n, k in [(1, 4096, 4096), (4, 4096, 4096), (16, 6144, 4096),
                                                       (64, 4096, 4096)]),
)


def mm_inputs(shape: dict, device: str) -> tuple:
    import torch

    dtype = dtype_of(shape)
    # Scaled so outputs stay O(1) whatever K is, which keeps bf16 tolerances meaningful.
    a = torch.randn(shape["m"], shape["k"], device=device, dtype=dtype)
    b = torch.randn(shape["n"], shape["k"], device=device, dtype=dtype) / shape["k"] ** 0.5
    return (a, b)


def mm_shape(a, b) -> dict:
    m, n, k = _mm_key(a, b, token_bucket_up)  # the dispatcher's bucket, so a [..., K] `a` records its M too
    return {"m": m, "n": n, "k": k, "dtype": dtype_name(a)}


def _mm_key(a, b, tokens_key) -> tuple:
    n, k = b.shape
    shape = a.shape
    return tokens_key(shape[0] if len(shape) == 2 else a.numel() // k), n, k


def _weight(n, k) -> str:
    """The weight's shape as a bucket component that is a name, not a number: the nearest-bucket rule
    (autosel.dispatch) moves along the token count only, never to another weight. Which GEMM kernel wins
    turns between weights a few percent apart (on the H200, graph replays of one weight: triton 0.78-0.85x
    cuBLAS's time at 9-16 tokens of 4096 x 4096, 1.15-1.9x at 7-21 tokens of 5120 x 3072, 4608 x 3584 and
    2816 x 5120; commit c134b65), so a tuned weight says nothing of its neighbours."""
    return f"{n}x{k}"


def mm_bucket(a, b) -> tuple:
    """(token_bucket_up(m), "NxK"): the token count rounded up to a power of two, and the weight's shape. Run
    once per distinct pair of shapes (route_key=(0, 1))."""
    m, n, k = _mm_key(a, b, token_bucket_up)
    return m, _weight(n, k)


def _mm_traced(a, b) -> tuple:  # what torch.compile traces
    tokens, n, k = _mm_key(a, b, lambda count: TracedTokens(count, up=True))
    # operator.index specialises a symbolic width (dynamic=True), as the dispatcher's traced lookup does.
    return tokens, _weight(operator.index(n), operator.index(k))


mm_bucket.traced = _mm_traced


SPECS = standard_specs("gemm.mm", "mm")
DEFINITIONS = [OpDefinition("gemm.mm", shapes=SHAPES, make_inputs=mm_inputs, shape_of=mm_shape, bucket=mm_bucket,
                            route_key=(0, 1), weights=(1,),
                            signature="(a[M, K], b[N, K]) -> new [M, N] = a @ b.T (nn.Linear layout); " + DTYPES,
                            traced="autosel.ops.opaque:mm")]
